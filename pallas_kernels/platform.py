"""Which platform a kernel is compiled for, shared by the ops' dispatchers; how a kernel pass is
jitted, and the call of a Triton-only kernel."""

import functools

import jax


def target_platform(mesh=None, platform=None) -> str:
  """"gpu", "tpu" or "cpu": platform, else the mesh's devices' (so AOT for a TPU topology
  gets "tpu" on a CPU host), else `jax.default_backend()`."""
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  return "gpu" if platform == "cuda" else platform


def load_runtimes(platform: str) -> None:
  """Makes the kernels' host libraries findable as lowering them would: a compiled program
  loaded from disk runs Mosaic GPU kernels without lowering any (whose import names
  Mosaic GPU's runtime library to XLA's custom call)."""
  if target_platform(platform=platform) == "gpu":
    try:
      import jax.experimental.mosaic.gpu  # noqa: F401, PLC0415
    except ImportError:   # a jaxlib without Mosaic GPU runs no such kernel
      pass


def triton_call(kernel, *args, interpret: bool, num_warps: int = 4, num_stages: int = 1,
                **specs):
  """`pl.pallas_call(kernel, **specs)(*args)` with Triton's compiler settings, none when
  interpreted; specs: grid, in_specs, out_specs, out_shape."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    params = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages))
  return pl.pallas_call(kernel, interpret=interpret, **params, **specs)(*args)


def lowered_once(*static_argnums: int, static_argnames=()):
  """Decorator: a kernel pass jitted with its settings static, so a program lowers each
  distinct call's kernels once, not at every layer, microbatch and remat copy that makes it."""
  return functools.partial(jax.jit, static_argnums=static_argnums,
                           static_argnames=static_argnames)

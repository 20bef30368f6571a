"""Which platform a kernel is compiled for, shared by the ops' dispatchers."""

import jax


def target_platform(mesh=None, platform=None) -> str:
  """"gpu", "tpu" or "cpu": platform, else the mesh's devices' (so AOT for a TPU topology
  gets "tpu" on a CPU host), else `jax.default_backend()`."""
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  return "gpu" if platform == "cuda" else platform

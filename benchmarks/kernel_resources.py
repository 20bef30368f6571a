"""Registers, spill stack and shared memory of the KDA (or short-conv) kernels on an
H100/H200, from a CPU.

The kernels are lowered for CUDA by JAX (no GPU needed) and their Triton IR compiled for
sm_90 by the `triton` package from PyPI (`pip install triton`; not a k3jax dependency, a
development tool), whose ptxas and cuobjdump report each kernel's resources. This is the
quick loop for register pressure, which bounds `chunk_bwd` (results/kda.md, session 8:
255 registers and a 1 KiB spill stack per thread here, as Nsight Compute measured on the
H200). pip's Triton is not the one inside jaxlib, so the numbers can drift from the
device's by a few registers; compare variants with each other.

    python benchmarks/kernel_resources.py --warps 4,8 --chunk 16 --dim 128
    python benchmarks/kernel_resources.py --tuning bwd_warps=4
    python benchmarks/kernel_resources.py --op short_conv --warps 4 --tuning block_t=32
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp


def triton_modules(lower_for_cuda):
  """{kernel name: Triton IR text} of the Pallas kernels that lower_for_cuda() lowers for
  CUDA. The modules are caught at JAX's private Pallas-Triton lowering hook (as of JAX
  0.10.2): JAX hands XLA only their bytecode."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: PLC0415
  lower = registration.lowering.lower_jaxpr_to_triton_module
  modules = {}

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    text = result.module.operation.get_asm(enable_debug_info=False)
    name = re.search(r"tt.func (?:public )?@(\w+)", text).group(1)
    if name in modules:  # lowered twice (save_states=False: prep, rec_fwd): keep both
      name += f" ({sum(n.split()[0] == name for n in modules) + 1})"
    modules[name] = text
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    lower_for_cuda()
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules


def _sd(*shape, dt=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dt)


def lower_kda(chunk, dim, tuning):
  """The forward and backward of `kda_pallas` (bf16, an fp32 gate as the model's layer
  passes it)."""
  from pallas_kernels.kda import kda_pallas  # noqa: PLC0415
  B, T, H = 1, 4 * chunk, 1
  args = (_sd(B, T, H, dim), _sd(B, T, H, dim), _sd(B, T, H, dim),
          _sd(B, T, H, dim, dt=jnp.float32), _sd(B, T, H), _sd(B, H, dim, dim, dt=jnp.float32))

  def loss(q, k, v, g, beta, h0):
    o, s = kda_pallas(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                      platform="gpu", chunk_size=chunk, **tuning)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  grad = jax.grad(loss, argnums=tuple(range(6)))
  jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",))


def lower_short_conv(dim, tuning):
  """The forward and backward of `short_conv_pallas` (bf16, q/k's form: L2 norm)."""
  from pallas_kernels.short_conv import short_conv_pallas  # noqa: PLC0415

  def loss(x, w, seg):
    y = short_conv_pallas(x, w, seg, normalize=True, **tuning)
    return jnp.sum(y.astype(jnp.float32))

  jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(
      _sd(1, 256, 1, dim), _sd(4, 1, dim, dt=jnp.float32), _sd(1, 256, dt=jnp.int32)).lower(
          lowering_platforms=("cuda",))


def resources(text, warps):
  """(registers, spill stack bytes, shared memory bytes, SASS instructions, of them tensor-core
  HMMA) per thread / block / kernel of one kernel compiled for sm_90 at `warps` warps. The
  instruction counts are static: a loop-free kernel (prep, chunk_cots, chunk_bwd) issues each
  once per warp, so fewer means a shorter program."""
  import triton  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(text)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=1))
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True,
                           text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
  field = lambda name: int(re.search(rf"{name}:(\d+)", usage).group(1))
  instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
  hmma = sum(op.startswith("HMMA") for op in instructions)
  return field("REG"), field("STACK"), kernel.metadata.shared, len(instructions), hmma


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--op", default="kda", choices=["kda", "short_conv"])
  p.add_argument("--warps", default="4,8")
  p.add_argument("--chunk", type=int, default=16)
  p.add_argument("--dim", type=int, default=128, help="K = V")
  p.add_argument("--tuning", nargs="*", default=[],
                 help="kda_pallas (or short_conv_pallas) keywords, name=value")
  a = p.parse_args()
  parse = lambda v: int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)
  tuning = {k: parse(v) for k, v in (t.split("=") for t in a.tuning)}
  if a.op == "kda":
    modules = triton_modules(lambda: lower_kda(a.chunk, a.dim, tuning))
    print(f"chunk {a.chunk}, K = V = {a.dim}, {tuning or 'defaults'}; sm_90, triton (PyPI)")
  else:
    modules = triton_modules(lambda: lower_short_conv(a.dim, tuning))
    print(f"short conv, D = {a.dim}, {tuning or 'defaults'}; sm_90, triton (PyPI)")
  print("| kernel | warps | registers | spill stack B | shared KiB | instructions | HMMA |\n"
        "|---|---|---|---|---|---|---|")
  for name, text in modules.items():
    for warps in map(int, a.warps.split(",")):
      regs, stack, shared, count, hmma = resources(text, warps)
      print(f"| {name} | {warps} | {regs} | {stack} | {shared / 1024:.1f} | {count:,} | "
            f"{hmma:,} |", flush=True)


if __name__ == "__main__":
  main()

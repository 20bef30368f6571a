"""Registers, spill stack and shared memory of the KDA kernels on an H100/H200, from a CPU.

The kernels are lowered for CUDA by JAX (no GPU needed) and their Triton IR compiled for
sm_90 by the `triton` package from PyPI (`pip install triton`; not a k3jax dependency, a
development tool), whose ptxas and cuobjdump report each kernel's resources. This is the
quick loop for register pressure, which bounds `chunk_bwd` (results/kda.md, session 8:
255 registers and a 1 KiB spill stack per thread here, as Nsight Compute measured on the
H200). pip's Triton is not the one inside jaxlib, so the numbers can drift from the
device's by a few registers; compare variants with each other.

    python benchmarks/kernel_resources.py --warps 4,8 --chunk 16 --dim 128
    python benchmarks/kernel_resources.py --tuning bwd_warps=4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp


def triton_modules(chunk, dim, tuning):
  """{kernel name: Triton IR text} of the forward and backward of `kda_pallas` (bf16,
  an fp32 gate as the model's layer passes it), lowered for CUDA. The module is caught at
  JAX's private Pallas-Triton lowering hook (as of JAX 0.10.2): JAX hands XLA only its
  bytecode."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: PLC0415

  from pallas_kernels.kda import kda_pallas  # noqa: PLC0415
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
    B, T, H = 1, 4 * chunk, 1
    sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    args = (sd(B, T, H, dim), sd(B, T, H, dim), sd(B, T, H, dim),
            sd(B, T, H, dim, dt=jnp.float32), sd(B, T, H), sd(B, H, dim, dim, dt=jnp.float32))

    def loss(q, k, v, g, beta, h0):
      o, s = kda_pallas(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        platform="gpu", chunk_size=chunk, **tuning)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    grad = jax.grad(loss, argnums=tuple(range(6)))
    jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules


def resources(text, warps):
  """(registers, spill stack bytes, shared memory bytes) per thread / block of one kernel
  compiled for sm_90 at `warps` warps."""
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
  field = lambda name: int(re.search(rf"{name}:(\d+)", usage).group(1))
  return field("REG"), field("STACK"), kernel.metadata.shared


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--warps", default="4,8")
  p.add_argument("--chunk", type=int, default=16)
  p.add_argument("--dim", type=int, default=128, help="K = V")
  p.add_argument("--tuning", nargs="*", default=[], help="kda_pallas fields, name=value")
  a = p.parse_args()
  parse = lambda v: int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)
  tuning = {k: parse(v) for k, v in (t.split("=") for t in a.tuning)}
  modules = triton_modules(a.chunk, a.dim, tuning)
  print(f"chunk {a.chunk}, K = V = {a.dim}, {tuning or 'defaults'}; sm_90, triton (PyPI)")
  print("| kernel | warps | registers | spill stack B | shared KiB |\n|---|---|---|---|---|")
  for name, text in modules.items():
    for warps in map(int, a.warps.split(",")):
      regs, stack, shared = resources(text, warps)
      print(f"| {name} | {warps} | {regs} | {stack} | {shared / 1024:.1f} |", flush=True)


if __name__ == "__main__":
  main()

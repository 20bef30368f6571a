"""Grouped matmuls on the H100 / H200 as Pallas Mosaic GPU kernels: JAX's own library
kernels (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` and
`transposed_ragged_dot_mgpu`: persistent, TMA-fed, wgmma), called here, not copied.

They want bf16 / fp16 operands of one dtype and tile sizes that divide the matmul (`check`
names what does not). Rows past the groups are left unwritten by the kernel; `gmm` zeroes
them, so its result equals the reference's. The tile sizes (`BLOCKS`) are the fastest of
each product on the H200 (`benchmarks/grouped_matmul.py --sweep`). `gmm` lowers from a CPU
host and runs in Mosaic GPU's interpreter there (tests do both); `tgmm` reads the device's
SM count when it is traced, so it lowers on a GPU host only.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes and pipelining of one product (the library kernels' keywords)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


# The fastest of benchmarks/grouped_matmul.py --sweep on the H200 at k3_small's experts
# (M 65536, K 1024, N 768, 64 groups; benchmarks/results/moe.md), for each of the three
# products (the forward, gmm on rhs^T for the lhs gradient, the weight gradient): 341 / 306
# / 514 TFLOP/s, against 282 / 257 / 460 with the library's defaults (4 steps, 1).
BLOCKS = Blocks(max_concurrent_steps=6, grid_block_n=4)
DTYPES = (jnp.bfloat16, jnp.float16)


def check(lhs, rhs):
  """Raises ValueError naming what the kernels cannot take: lhs [M, K] and rhs [G, K, N] of
  one 16-bit dtype, M a multiple of 8 (the TMA tile of rows); the forward's K by block_k,
  the lhs gradient's (the product on rhs^T) N by its block_k, the weight gradient's K by
  block_m and N by block_n."""
  m, k = lhs.shape
  _, _, n = rhs.shape
  if lhs.dtype != rhs.dtype or lhs.dtype not in DTYPES:
    raise ValueError(f"the grouped-matmul kernel takes bf16 or fp16 operands of one dtype, "
                     f"got {lhs.dtype} and {rhs.dtype}")
  for dim, size, tile, what in (
      (m, "M", 8, "8 rows"), (k, "K", BLOCKS.block_k, "block_k"),
      (n, "N", BLOCKS.block_k, "the lhs gradient's block_k"),
      (k, "K", BLOCKS.block_m, "the weight gradient's block_m"),
      (n, "N", BLOCKS.block_n, "the weight gradient's block_n")):
    if dim % tile:
      raise ValueError(f"the grouped-matmul kernel needs {size}={dim} to be a multiple of "
                       f"{what}={tile}")


def gmm(lhs, rhs, group_sizes, transpose_rhs=False, blocks=BLOCKS, interpret=False):
  """As `reference.gmm`: [M, K] x [G, K, N] ([G, N, K] if transpose_rhs) -> [M, N].

  interpret: run in Mosaic GPU's interpreter (on a CPU; JAX 0.10's cannot take
  transpose_rhs).
  """
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415
  with _interpreted() if interpret else contextlib.nullcontext():
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32),
                                     transpose_rhs=transpose_rhs, **dataclasses.asdict(blocks))
  # rows past the groups: XLA fuses this select into what reads the product
  rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def tgmm(lhs, rhs, group_sizes, blocks=BLOCKS):
  """As `reference.tgmm`: [M, K], [M, N] -> [G, K, N], per group lhs^T rhs."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: PLC0415
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), **dataclasses.asdict(blocks))


def _interpreted():
  # JAX exports no name for it yet (0.10 - 0.11): Mosaic GPU kernels traced inside run in
  # its interpreter.
  from jax._src.pallas.mosaic_gpu.interpret import params  # noqa: PLC0415
  return params.force_gpu_interpret_mode(params.InterpretGPUParams())

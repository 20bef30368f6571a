"""Grouped matmuls on the H100 / H200 as Pallas Mosaic GPU kernels: JAX's own library
kernels (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` and
`transposed_ragged_dot_mgpu`: persistent, TMA-fed, wgmma), called here, not copied.

They want bf16 / fp16 operands of one dtype, and tile sizes that divide the matmul: K by
block_k for `gmm`; for `tgmm` the output's [K, N] by (block_m, block_n). Rows past the
groups are left unwritten by the kernel; `gmm` zeroes them, so its result equals the
reference's. Tile sizes (`Blocks`) are per product. Mosaic GPU lowers from a CPU host for
`gmm` (tests check it); `tgmm` reads the device's SM count when it is traced, so it lowers
on a GPU host only.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes and pipelining of one product (the library kernels' keywords)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


# Not yet tuned on the H200 (the library's own sweep spans blocks of 64-192 and 2-6
# concurrent steps): benchmarks/grouped_matmul.py --sweep.
GMM, TGMM = Blocks(), Blocks()
DTYPES = (jnp.bfloat16, jnp.float16)


def check(lhs, rhs, gmm_blocks=GMM, tgmm_blocks=TGMM):
  """Raises ValueError naming what the kernels cannot take: lhs [M, K] and rhs [G, K, N]
  of one 16-bit dtype, M a multiple of 8 (the TMA tile of rows), K and N multiples of the
  tiles (the forward's K by block_k and N by block_n; the weight gradient's K by block_m
  and N by block_n)."""
  m, k = lhs.shape
  _, _, n = rhs.shape
  if lhs.dtype != rhs.dtype or lhs.dtype not in DTYPES:
    raise ValueError(f"the grouped-matmul kernel takes bf16 or fp16 operands of one dtype, "
                     f"got {lhs.dtype} and {rhs.dtype}")
  for dim, size, tile, what in ((m, "M", 8, "8 rows"), (k, "K", gmm_blocks.block_k, "block_k"),
                                (n, "N", gmm_blocks.block_n, "block_n"),
                                (k, "K", tgmm_blocks.block_m, "the weight gradient's block_m"),
                                (n, "N", tgmm_blocks.block_n, "the weight gradient's block_n")):
    if dim % tile:
      raise ValueError(f"the grouped-matmul kernel needs {size}={dim} to be a multiple of "
                       f"{what}={tile}")


def _library(name):
  from jax.experimental.pallas.ops.gpu import (  # noqa: PLC0415  (imports Mosaic GPU)
      ragged_dot_mgpu, transposed_ragged_dot_mgpu)
  return {"gmm": ragged_dot_mgpu.ragged_dot,
          "tgmm": transposed_ragged_dot_mgpu.transposed_ragged_dot}[name]


def gmm(lhs, rhs, group_sizes, transpose_rhs=False, blocks=GMM):
  """As `reference.gmm`: [M, K] x [G, K, N] ([G, N, K] if transpose_rhs) -> [M, N]."""
  fn = _library("gmm")
  kw = dataclasses.asdict(blocks)
  if transpose_rhs:
    if "transpose_rhs" in inspect.signature(fn).parameters:
      kw["transpose_rhs"] = True
    else:  # older JAX: the kernel reads rhs as [G, K, N] only
      rhs = jnp.swapaxes(rhs, 1, 2)
  out = fn(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), **kw)
  rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def tgmm(lhs, rhs, group_sizes, blocks=TGMM):
  """As `reference.tgmm`: [M, K], [M, N] -> [G, K, N], per group lhs^T rhs."""
  return _library("tgmm")(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32),
                          **dataclasses.asdict(blocks))

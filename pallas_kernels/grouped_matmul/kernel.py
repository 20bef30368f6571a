"""Grouped matmuls as Pallas Mosaic GPU kernels (H100 / H200): `gmm` (forward; on rhs^T the
lhs gradient), a persistent kernel over an XLA-made tile list; `tgmm` (weight gradient), JAX's
`transposed_ragged_dot_mgpu`, which reads the SM count when traced (GPU hosts only)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tiles and pipelining of one product (the library kernel's keywords)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


# the H200's fastest for all three products at k3_small's experts (benchmarks/results/moe.md)
BLOCKS = Blocks(max_concurrent_steps=6, grid_block_n=4)
DTYPES = (jnp.bfloat16, jnp.float16)
H100_SMS = 132  # the persistent grid where no GPU says otherwise (interpreter, AOT)


def check(lhs, rhs):
  """ValueError naming what the kernels cannot take (dtype, tile multiples of M, K, N)."""
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


def tile_table(group_sizes, rows: int, block_m: int):
  """(table [4 T], count [1]): tile t < count, each row block once per group it holds rows of
  (rows past the groups as group G, written zero), is (group, row block, first row in the
  block, rows) at table[c T + t]; T = cdiv(rows, block_m) + G."""
  sizes = group_sizes.astype(jnp.int32)
  sizes = jnp.append(sizes, jnp.maximum(rows - jnp.sum(sizes), 0))
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  n_tiles = jnp.where(sizes > 0, (ends - 1) // block_m - starts // block_m + 1, 0)
  first = jnp.cumsum(n_tiles) - n_tiles
  t = jnp.arange(-(-rows // block_m) + sizes.shape[0] - 1, dtype=jnp.int32)
  # an empty group shares `first` with the next one, which wins
  group = jnp.clip(jnp.searchsorted(first, t, side="right", method="compare_all") - 1, 0,
                   sizes.shape[0] - 1)
  block = starts[group] // block_m + t - first[group]
  lo = jnp.maximum(starts[group], block * block_m)
  hi = jnp.minimum(ends[group], (block + 1) * block_m)
  table = jnp.concatenate([group, block, lo - block * block_m, hi - lo]).astype(jnp.int32)
  return table, jnp.sum(n_tiles, keepdims=True).astype(jnp.int32)


def gmm(lhs, rhs, group_sizes, transpose_rhs=False, blocks=BLOCKS, interpret=False,
        num_sms=None):
  """As `reference.gmm`: per (tile, column block) a TMA-fed wgmma pipeline over K, the rows
  stored in 2^j-row pieces (a TMA box is static). JAX 0.10 cannot interpret transpose_rhs."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  if k % bk or n % bn:
    raise ValueError(f"gmm: K={k} and N={n} must be multiples of block_k={bk} and "
                     f"block_n={bn}")
  table, count = tile_table(group_sizes, m, bm)
  num_tiles, num_groups, grid_n = table.shape[0] // 4, rhs.shape[0], n // bn

  def body(table_ref, count_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((count_ref[0] * grid_n,), collective_axes="sm")
    def _(loop):
      ti, ni = plgpu.planar_snake(loop.index[0], (count_ref[0], grid_n), 1,
                                  blocks.grid_block_n)
      group, block, start, size = (table_ref[c * num_tiles + ti] for c in range(4))

      def mma(_, lhs_smem, rhs_smem, acc_ref):
        plgpu.wgmma(acc_ref, lhs_smem,
                    plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem)

      def k_loop(acc_ref):  # the accumulator starts at zero: group G's tiles stay so
        @pl.when(group < num_groups)
        def _():
          plgpu.emit_pipeline(
              functools.partial(mma, acc_ref=acc_ref), grid=(k // bk,),
              in_specs=[
                  plgpu.BlockSpec((bm, bk), lambda ki: (block, ki), delay_release=1),
                  plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                  (lambda ki: (ni, ki)) if transpose_rhs
                                  else (lambda ki: (ki, ni)), delay_release=1)],
              max_concurrent_steps=blocks.max_concurrent_steps,
          )(lhs_ref, rhs_ref.at[jnp.minimum(group, num_groups - 1)])
        return acc_ref[...]

      acc = pl.run_scoped(k_loop, plgpu.ACC((bm, bn)))

      @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((bm, bn), out_ref.dtype))
      def _(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        row, j = start, 1 << (min(bm, m).bit_length() - 1)
        while j:
          @pl.when(size & j != 0)
          def _():
            plgpu.copy_smem_to_gmem(
                out_smem.at[pl.ds(row, j)],
                out_ref.at[pl.ds(block * bm + row, j), pl.ds(ni * bn, bn)])
          row = row + (size & j)
          j //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  run = persistent_kernel(body, jax.ShapeDtypeStruct((m, n), lhs.dtype), num_sms)
  with interpreted() if interpret else contextlib.nullcontext():
    return run(table, count, lhs, rhs)


def tgmm(lhs, rhs, group_sizes, blocks=BLOCKS):
  """As `reference.tgmm`: [M, K], [M, N] -> [G, K, N], per group lhs^T rhs."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: PLC0415
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), **dataclasses.asdict(blocks))


def persistent_kernel(body, out_type, num_sms, warpgroups=1):
  """A Mosaic GPU kernel of one CTA per SM (axis "sm"), warpgroups per CTA on axis "wg"."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  if num_sms is None:
    device = jax.devices()[0]
    num_sms = device.core_count if device.platform == "gpu" else H100_SMS
  threads = dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}
  return plgpu.kernel(
      body, out_type=out_type, grid=(num_sms,), grid_names=("sm",), **threads,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def interpreted():
  # JAX 0.10 - 0.11 export no name for Mosaic GPU's interpreter mode
  from jax._src.pallas.mosaic_gpu.interpret import params  # noqa: PLC0415
  return params.force_gpu_interpret_mode(params.InterpretGPUParams())

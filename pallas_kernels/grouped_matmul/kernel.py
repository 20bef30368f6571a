"""Grouped matmuls on the H100 / H200 as Pallas Mosaic GPU kernels.

  gmm   (the forward, and on rhs^T the lhs gradient) ours: a persistent kernel that walks a
        tile list computed in XLA (`tile_table`), so neither its compile nor its per-tile
        work grows with the number of groups (JAX's library `ragged_dot_mgpu` unrolls a
        search over every group into each tile: k3_small's train step did not finish
        compiling with it, and did with ours, benchmarks/results/moe.md), and no tile runs
        for a row block that holds no rows of its group;
  tgmm  (the weight gradient, per group lhs^T rhs) JAX's library kernel
        `transposed_ragged_dot_mgpu`, called here, not copied.

Both want bf16 / fp16 operands of one dtype and tile sizes that divide the matmul (`check`
names what does not). `gmm` writes rows past the groups as zeros, so its result equals the
reference's. The tile sizes (`BLOCKS`) are the fastest on the H200
(`benchmarks/grouped_matmul.py --sweep`). `gmm` lowers from a CPU host and runs in Mosaic
GPU's interpreter there (tests do both); `tgmm` reads the device's SM count when it is
traced, so it lowers on a GPU host only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes and pipelining of one product (the library kernel's keywords; ours takes
  the same)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1


# The fastest of benchmarks/grouped_matmul.py --sweep on the H200 at k3_small's experts
# (M 65536, K 1024, N 768, 64 groups; benchmarks/results/moe.md) for each of
# the three products (the forward, gmm on rhs^T for the lhs gradient, the weight gradient),
# with the library's kernels and again with ours; faster than the library's defaults
# (4 steps, 1).
BLOCKS = Blocks(max_concurrent_steps=6, grid_block_n=4)
DTYPES = (jnp.bfloat16, jnp.float16)
H100_SMS = 132  # the persistent grid where no GPU says otherwise (interpreter, AOT)


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


def tile_table(group_sizes, rows: int, block_m: int):
  """The forward's work list: every [block_m, :] row block once per group it holds rows of,
  and the blocks of the rows past the groups once more, as group G (they are written zero).

  group_sizes [G] int over `rows` sorted rows. Returns (table [4 * T] int32, count [1] int32):
  for tile t < count, table[t], table[T + t], table[2T + t], table[3T + t] are its group, its
  row block, the first of the group's rows within the block and their number. Empty groups
  have no tile; T = cdiv(rows, block_m) + G bounds the count (a group boundary splits at
  most one block). Entries past the count are never read.
  """
  sizes = group_sizes.astype(jnp.int32)
  sizes = jnp.append(sizes, jnp.maximum(rows - jnp.sum(sizes), 0))  # group G: the rest
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  n_tiles = jnp.where(sizes > 0, (ends - 1) // block_m - starts // block_m + 1, 0)
  first = jnp.cumsum(n_tiles) - n_tiles  # [G + 1] each group's first tile
  t = jnp.arange(-(-rows // block_m) + sizes.shape[0] - 1, dtype=jnp.int32)
  # the last group whose first tile is <= t: an empty group shares its `first` with the
  # next group, which comes later and so wins
  group = jnp.clip(jnp.searchsorted(first, t, side="right", method="compare_all") - 1, 0,
                   sizes.shape[0] - 1)
  block = starts[group] // block_m + t - first[group]
  lo = jnp.maximum(starts[group], block * block_m)
  hi = jnp.minimum(ends[group], (block + 1) * block_m)
  table = jnp.concatenate([group, block, lo - block * block_m, hi - lo]).astype(jnp.int32)
  return table, jnp.sum(n_tiles, keepdims=True).astype(jnp.int32)


def gmm(lhs, rhs, group_sizes, transpose_rhs=False, blocks=BLOCKS, interpret=False,
        num_sms=None):
  """As `reference.gmm`: [M, K] x [G, K, N] ([G, N, K] if transpose_rhs) -> [M, N].

  A persistent kernel (one CTA per SM) walks `tile_table`'s tiles x the column blocks: per
  tile a TMA-fed wgmma pipeline over K into an fp32 [block_m, block_n] accumulator, then
  TMA stores of the group's rows in the block (2^j rows each: a row count is data, a TMA
  box is static). num_sms: the CTAs (None: the GPU's SM count, else the H100 / H200's
  132). interpret: run in Mosaic GPU's interpreter (on a CPU; JAX 0.10's cannot take
  transpose_rhs).
  """
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
        while j:  # the `size` rows from `start`: one store of 2^j rows per bit of size
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
  """A Mosaic GPU kernel of one CTA per SM (grid axis "sm"; num_sms None: the GPU's SM
  count, else the H100 / H200's 132) in warpgroup semantics; warpgroups > 1: that many per
  CTA (axis "wg")."""
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
  # JAX exports no name for it yet (0.10 - 0.11): Mosaic GPU kernels traced inside run in
  # its interpreter.
  from jax._src.pallas.mosaic_gpu.interpret import params  # noqa: PLC0415
  return params.force_gpu_interpret_mode(params.InterpretGPUParams())

"""Warp-specialized grouped matmuls (Pallas Mosaic GPU): `gmm_ws` over `kernel.tile_table`,
`tgmm_ws` over (group, K block, N block) tiles. A memory warpgroup streams K blocks while two
compute warpgroups run wgmma into fp32 halves of [block_m, 2 block_n]."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.kernel import (DTYPES, interpreted, persistent_kernel,
                                                  tile_table)


@dataclasses.dataclass(frozen=True)
class WSBlocks:
  """K in block_k steps through max_concurrent_steps slots, stores epi_n columns at a time;
  chain: one K pipeline across tiles (max_concurrent_steps must divide K / block_k)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 4
  epi_n: int = 64
  chain: bool = True


WS_BLOCKS = WSBlocks()


def check_ws(lhs, rhs, blocks=WS_BLOCKS):
  """ValueError naming what the kernels cannot take (dtype, tile multiples of M, K, N)."""
  m, k = lhs.shape
  n = rhs.shape[2]
  if lhs.dtype != rhs.dtype or lhs.dtype not in DTYPES:
    raise ValueError(f"the grouped-matmul kernels take bf16 or fp16 operands of one dtype, "
                     f"got {lhs.dtype} and {rhs.dtype}")
  step = blocks.block_k * (blocks.max_concurrent_steps if blocks.chain else 1)
  for dim, name, tile, what in (
      (k, "K", 2 * blocks.block_n, "2 block_n"), (n, "N", 2 * blocks.block_n, "2 block_n"),
      (k, "K", step, "block_k x the pipeline's steps"),
      (n, "N", step, "block_k x the pipeline's steps"), (m, "M", blocks.block_k, "block_k"),
      (k, "K", blocks.block_m, "block_m")):
    if dim % tile:
      raise ValueError(f"the warp-specialized grouped-matmul kernels need {name}={dim} to be "
                       f"a multiple of {what}={tile}")


def _store_rows(out_smem, wg, out_ref, start, size, row_base, col, width, max_rows):
  """Rows [start, start + size) of warpgroup wg's out_smem [wg, rows, width] to out_ref at
  (row_base + row, col), as copies of power-of-two row counts (size's binary digits)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  row, j = start, 1 << (max_rows.bit_length() - 1)
  while j:
    @pl.when(size & j != 0)
    def _(row=row, j=j):
      plgpu.copy_smem_to_gmem(out_smem.at[wg, pl.ds(row, j)],
                              out_ref.at[pl.ds(row_base + row, j), pl.ds(col, width)])
    row = row + (size & j)
    j //= 2


def gmm_ws(lhs, rhs, group_sizes, transpose_rhs=False, blocks=WS_BLOCKS, interpret=False,
           num_sms=None):
  """As `gmm`; blocks.chain: one pipeline across tiles (START / STEADY / STOP)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  from jax._src.pallas.mosaic_gpu.pipeline import PipelinePipeline  # noqa: PLC0415
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk, steps = blocks.block_m, blocks.block_n, blocks.block_k, blocks.max_concurrent_steps
  if k % bk or n % (2 * bn) or (blocks.chain and (k // bk) % steps) or bn % blocks.epi_n:
    raise ValueError(f"gmm_ws: K={k} must be a multiple of block_k={bk} in a multiple of "
                     f"{steps} steps, N={n} of 2 block_n={2 * bn}, block_n of epi_n; {blocks}")
  table, count = tile_table(group_sizes, m, bm)
  num_tiles, num_groups, grid_n = table.shape[0] // 4, rhs.shape[0], n // (2 * bn)
  epi = blocks.epi_n

  def pipeline(block, ni, body, compute_context, state):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k // bk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=steps, compute_context=compute_context, pipeline_state=state,
        in_specs=[
            plgpu.BlockSpec((bm, bk), lambda ki: (block, ki), memory_space=plgpu.SMEM),
            plgpu.BlockSpec((2 * bn, bk) if transpose_rhs else (bk, 2 * bn),
                            (lambda ki: (ni, ki)) if transpose_rhs else (lambda ki: (ki, ni)),
                            memory_space=plgpu.SMEM)])

  def body(table_ref, count_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None  # the allocations depend on the specs' shapes alone
    allocs = pipeline(0, 0, ignore, ignore, None).get_allocations(lhs_ref, rhs_ref.at[0])

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((2, bm, epi), out_ref.dtype), collective_axes="wg")
    def _(allocs, out_smem):
      wg = jax.lax.axis_index("wg")

      @plgpu.nd_loop((count_ref[0] * grid_n,), collective_axes="sm")
      def _(loop):
        ti, ni = plgpu.planar_snake(loop.index[0], (count_ref[0], grid_n), 1,
                                    blocks.grid_block_n)
        group, block, start, size = (table_ref[c * num_tiles + ti] for c in range(4))
        state = jnp.where(loop.local_index == 0, int(PipelinePipeline.START),
                          jnp.where(loop.local_index == loop.num_local_steps - 1,
                                    int(PipelinePipeline.STOP), int(PipelinePipeline.STEADY)))

        def mma(_, lhs_smem, rhs_smem, acc_ref):
          cols = pl.ds(wg * bn, bn)
          @pl.when(group < num_groups)  # group G: the rows past the groups, left zero
          def _():
            plgpu.wgmma(acc_ref, lhs_smem,
                        plgpu.transpose_ref(rhs_smem.at[cols, :], (1, 0)) if transpose_rhs
                        else rhs_smem.at[:, cols])
            plgpu.wgmma_wait(0)
          return acc_ref

        def store(e):
          _store_rows(out_smem, wg, out_ref, start, size, block * bm,
                      ni * 2 * bn + wg * bn + e * epi, epi, min(bm, m))

        compute_context = _ws_compute_context(bm, bn, epi, out_smem, wg, store)

        args = (lhs_ref, rhs_ref.at[jnp.minimum(group, num_groups - 1)])
        # a lone tile both starts and stops the chain: the plain pipeline
        one = (loop.num_local_steps == 1) | (not blocks.chain)

        @pl.when(one)
        def _():
          pipeline(block, ni, mma, compute_context, None)(*args, allocations=allocs)

        if blocks.chain:
          @pl.when(jnp.logical_not(one))
          def _():
            pipeline(block, ni, mma, compute_context, state)(*args, allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  run = persistent_kernel(body, jax.ShapeDtypeStruct((m, n), lhs.dtype), num_sms,
                           warpgroups=3)
  with interpreted() if interpret else contextlib.nullcontext():
    return run(table, count, lhs, rhs)


def tgmm_ws(lhs, rhs, group_sizes, blocks=WS_BLOCKS, interpret=False, num_sms=None,
            lhs_transposed=False):
  """As `tgmm`: a CTA tile is one group's [block_m, 2 block_n], rhs rows outside the group
  zeroed in shared memory. lhs_transposed: lhs [K, M] (JAX 0.10's interpreter runs it)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  k, m = lhs.shape if lhs_transposed else lhs.shape[::-1]
  n = rhs.shape[1]
  bm, bn, br, epi = blocks.block_m, blocks.block_n, blocks.block_k, blocks.epi_n
  if k % bm or n % (2 * bn) or m % br or bn % epi:
    raise ValueError(f"tgmm_ws: K={k} must be a multiple of block_m={bm}, N={n} of 2 "
                     f"block_n={2 * bn}, M={m} of block_k={br}, block_n of epi_n; {blocks}")
  num_groups = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  bounds = jnp.concatenate([ends - group_sizes.astype(jnp.int32), ends])
  grid_k, grid_n = k // bm, n // (2 * bn)

  def pipeline(first, num_blocks, ki, ni, body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(num_blocks,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=blocks.max_concurrent_steps, compute_context=compute_context,
        in_specs=[
            plgpu.BlockSpec((bm, br), lambda r: (ki, first + r), memory_space=plgpu.SMEM)
            if lhs_transposed else
            plgpu.BlockSpec((br, bm), lambda r: (first + r, ki), memory_space=plgpu.SMEM),
            plgpu.BlockSpec((br, 2 * bn), lambda r: (first + r, ni), memory_space=plgpu.SMEM)])

  def body(bounds_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None
    # (a grid of at least max_concurrent_steps: a shorter static one gets fewer slots)
    allocs = pipeline(0, blocks.max_concurrent_steps, 0, 0, ignore, ignore).get_allocations(
        lhs_ref, rhs_ref)

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((2, bm, epi), out_ref.dtype), collective_axes="wg")
    def _(allocs, out_smem):
      wg = jax.lax.axis_index("wg")
      cols = pl.ds(wg * bn, bn)

      @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
      def _(loop):
        g = loop.index[0]
        ki, ni = plgpu.planar_snake(loop.index[1], (grid_k, grid_n), 1, blocks.grid_block_n)
        start, end = bounds_ref[g], bounds_ref[num_groups + g]
        first = jnp.minimum(start // br, m // br - 1)  # an empty last group starts at M
        # an empty group: one block, every row masked, so the result is zero
        num_blocks = jnp.maximum((end + br - 1) // br - first, 1)

        def mma(r, lhs_smem, rhs_smem, acc_ref):
          half = rhs_smem.at[:, cols]

          @pl.when((r[0] == 0) | (r[0] == num_blocks - 1))
          def _():
            row = (first + r[0]) * br + jax.lax.broadcasted_iota(jnp.int32, (br, bn), 0)
            vals = half[...]
            half[...] = jnp.where((row >= start) & (row < end), vals, jnp.zeros_like(vals))
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, lhs_smem if lhs_transposed
                      else plgpu.transpose_ref(lhs_smem, (1, 0)), half)
          plgpu.wgmma_wait(0)
          return acc_ref

        compute_context = _ws_compute_context(
            bm, bn, epi, out_smem, wg, lambda e: plgpu.copy_smem_to_gmem(
                out_smem.at[wg],
                out_ref.at[g, pl.ds(ki * bm, bm), pl.ds(ni * 2 * bn + wg * bn + e * epi, epi)]))

        pipeline(first, num_blocks, ki, ni, mma, compute_context)(
            lhs_ref, rhs_ref, allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  run = persistent_kernel(body, jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype),
                           num_sms, warpgroups=3)
  with interpreted() if interpret else contextlib.nullcontext():
    return run(bounds, lhs, rhs)


def _ws_compute_context(bm, bn, epi, out_smem, wg, store):
  """The K loop into an fp32 [bm, bn] accumulator, then store(e) of epi columns at a time."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415

  def compute_context(run_k_loop):
    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
    def _(acc_ref):
      run_k_loop(acc_ref)
      acc = acc_ref[...]
      for e in range(bn // epi):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = acc[:, e * epi:(e + 1) * epi].astype(out_smem.dtype)
        plgpu.commit_smem()
        store(e)
  return compute_context

"""Newton-Schulz's two symmetric products on Mosaic GPU (H100 / H200):
    symmetric_product(x, y, alpha, beta, gamma)[b] = alpha x[b] x[b]^T + beta y[b] + gamma I
for x [B, m, k] and y [B, m, m] symmetric (A = X X^T, then a I + b A + c A A with x = y = A).
Only the [128, 128] tiles on and above the diagonal are multiplied, accumulated in fp32 and
rounded once; a tile above the diagonal is stored twice, its mirror made by a wgmma against
a 64 x 64 identity (Mosaic GPU stores no register tile transposed). `newton_schulz_symmetric`
runs the standard form on it, P X by XLA."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul.kernel import persistent_kernel
from pallas_kernels.newton_schulz.reference import COEFFS, EPS, STEPS, standard_form
from pallas_kernels.platform import lowered_once

TILE = 128  # rows and columns of a warpgroup's tile; a CTA covers [TILE, 2 TILE]
_HALF = 64  # the mirror's rows per wgmma (the identity is [_HALF, _HALF])


@dataclasses.dataclass(frozen=True)
class SymmetricBlocks:
  """The contraction's steps and the pipeline's depth."""
  block_k: int = 64
  max_concurrent_steps: int = 3  # shared memory: 3 x 48 KiB of operands + 80 KiB of tiles


def fits(shape, dtype) -> bool:
  """Whether the kernel takes blocks [..., m, n] of dtype (short side a multiple of 256)."""
  m, n = sorted(shape[-2:])
  return (jnp.dtype(dtype) == jnp.bfloat16 and m % (2 * TILE) == 0
          and n % SymmetricBlocks.block_k == 0)


def upper_tiles(m: int) -> np.ndarray:
  """[2 T]: row tile i (first T) and column pair p (last T) of each CTA tile [TILE, 2 TILE]
  holding a warpgroup tile (i, j = 2p or 2p + 1) with j >= i."""
  pairs = [(i, p) for p in range(m // (2 * TILE)) for i in range(m // TILE) if i <= 2 * p + 1]
  return np.asarray(pairs, np.int32).T.reshape(-1).copy()


def symmetric_product_reference(x, y=None, *, alpha=1.0, beta=0.0, gamma=0.0):
  """The products in fp32, rounded once to x's dtype: [B, m, k], [B, m, m] -> [B, m, m]."""
  xf = x.astype(jnp.float32)
  out = alpha * jnp.einsum("bmk,bnk->bmn", xf, xf, precision=jax.lax.Precision.HIGHEST)
  if y is not None:
    out = out + beta * y.astype(jnp.float32)
  return (out + gamma * jnp.eye(x.shape[1], dtype=jnp.float32)).astype(x.dtype)


@lowered_once(static_argnames=("alpha", "beta", "gamma", "blocks", "num_sms"))
def symmetric_product(x, y=None, *, alpha=1.0, beta=0.0, gamma=0.0,
                      blocks=SymmetricBlocks(), num_sms=None):
  """As `symmetric_product_reference`, one persistent warp-specialized kernel."""
  nb, m, k = x.shape
  if m % (2 * TILE) or k % blocks.block_k or x.dtype != jnp.bfloat16:
    raise ValueError(f"symmetric_product takes bf16 [B, m, k] with m a multiple of "
                     f"{2 * TILE} and k of {blocks.block_k}, got {x.dtype} {x.shape}")
  if y is not None and (y.shape != (nb, m, m) or y.dtype != x.dtype):
    raise ValueError(f"symmetric_product: y must be {x.dtype} {(nb, m, m)}, got {y.dtype} "
                     f"{y.shape}")
  body = functools.partial(_body, nb=nb, m=m, k=k, with_y=y is not None, blocks=blocks,
                           scale=(alpha, beta, gamma))
  run = persistent_kernel(body, jax.ShapeDtypeStruct((nb, m, m), x.dtype), num_sms,
                          warpgroups=3)
  return run(jnp.asarray(upper_tiles(m)), x, *(() if y is None else (y,)))


def _body(tiles_ref, x_ref, *refs, nb, m, k, with_y, blocks, scale):
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  y_ref, out_ref = refs if with_y else (None, refs[0])
  num_tiles = tiles_ref.shape[0] // 2
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def pipeline(i, p, mma, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        mma, grid=(k // blocks.block_k,), memory_registers=40, wg_axis="wg",
        num_compute_wgs=2, max_concurrent_steps=blocks.max_concurrent_steps,
        compute_context=compute_context,
        in_specs=[plgpu.BlockSpec((TILE, blocks.block_k), lambda ki: (i, ki),
                                  memory_space=plgpu.SMEM),
                  plgpu.BlockSpec((2 * TILE, blocks.block_k), lambda ki: (p, ki),
                                  memory_space=plgpu.SMEM)])

  ignore = lambda *_, **__: None  # the allocations depend on the specs' shapes alone
  allocs = pipeline(0, 0, ignore, ignore).get_allocations(x_ref.at[0], x_ref.at[0])

  @functools.partial(pl.run_scoped, allocs=allocs,
                     tile_smem=plgpu.SMEM((2, TILE, TILE), x_ref.dtype, transforms=swizzled),
                     eye_smem=plgpu.SMEM((2, _HALF, _HALF), x_ref.dtype, transforms=swizzled),
                     bar=plgpu.Barrier(num_barriers=2), collective_axes="wg")
  def _(allocs, tile_smem, eye_smem, bar):
    wg = jax.lax.axis_index("wg")

    @pl.when(wg < 2)  # the compute warpgroups' identities
    def _():
      rows = jax.lax.broadcasted_iota(jnp.int32, (_HALF, _HALF), 0)
      cols = jax.lax.broadcasted_iota(jnp.int32, (_HALF, _HALF), 1)
      eye_smem[wg] = (rows == cols).astype(x_ref.dtype)
      plgpu.commit_smem()

    @plgpu.nd_loop((nb * num_tiles,), collective_axes="sm")
    def _(loop):
      b, t = loop.index[0] // num_tiles, loop.index[0] % num_tiles
      i, p = tiles_ref[t], tiles_ref[num_tiles + t]
      j = 2 * p + wg  # this warpgroup's column tile

      def mma(_, lhs_smem, rhs_smem, acc_ref):
        @pl.when(j >= i)
        def _():
          plgpu.wgmma(acc_ref, lhs_smem,
                      plgpu.transpose_ref(rhs_smem.at[pl.ds(wg * TILE, TILE), :], (1, 0)))
          plgpu.wgmma_wait(0)
        return acc_ref

      epilogue = functools.partial(
          _epilogue, tile=tile_smem.at[wg], eye=eye_smem.at[wg], bar=bar.at[wg],
          y_tile=None if y_ref is None else y_ref.at[b, pl.ds(i * TILE, TILE),
                                                     pl.ds(j * TILE, TILE)],
          out=out_ref.at[b, pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)],
          mirror=out_ref.at[b, pl.ds(j * TILE, TILE), pl.ds(i * TILE, TILE)],
          i=i, j=j, scale=scale)
      pipeline(i, p, mma, epilogue)(x_ref.at[b], x_ref.at[b], allocations=allocs)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _epilogue(run_k_loop, *, tile, eye, bar, y_tile, out, mirror, i, j, scale):
  """One warpgroup's tile (i, j): the K loop into fp32, alpha acc + beta y + gamma I stored
  at (i, j) and, above the diagonal, transposed at (j, i). y's tile loads during the loop."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  alpha, beta, gamma = scale

  @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((TILE, TILE), jnp.float32))
  def _(acc_ref):
    if y_tile is not None:
      @pl.when(j >= i)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read it
        plgpu.copy_gmem_to_smem(y_tile, tile, bar)

    run_k_loop(acc_ref)

    @pl.when(j >= i)
    def _():
      acc = acc_ref[...] * alpha
      if y_tile is not None:
        plgpu.barrier_wait(bar)
        acc = acc + beta * tile[...].astype(jnp.float32)
      else:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if gamma:
        rows = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 1)
        acc = acc + jnp.where((rows == cols) & (i == j), gamma, 0.0)
      tile[...] = acc.astype(tile.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, out)

      @pl.when(j > i)
      def _():
        _store_mirror(tile, eye, mirror)


def _store_mirror(tile, eye, mirror):
  """tile^T to mirror: rows [h 64, h 64 + 64) of tile^T = I_64 @ (tile's columns there)^T."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415

  @functools.partial(pl.run_scoped, top=plgpu.ACC((_HALF, TILE), jnp.float32),
                     bottom=plgpu.ACC((_HALF, TILE), jnp.float32))
  def _(top, bottom):
    for h, acc in enumerate((top, bottom)):
      plgpu.wgmma(acc, eye, plgpu.transpose_ref(tile.at[:, pl.ds(h * _HALF, _HALF)], (1, 0)))
    plgpu.wgmma_wait(0)
    rows_top, rows_bottom = top[...].astype(tile.dtype), bottom[...].astype(tile.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (i, j)'s store has read the tile
    tile.at[pl.ds(0, _HALF)][...] = rows_top
    tile.at[pl.ds(_HALF, _HALF)][...] = rows_bottom
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, mirror)


def newton_schulz_symmetric(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, product=None):
  """The standard form (`reference.standard_form`) in bf16, A and the polynomial from
  `product` (default `symmetric_product`), P X by XLA; x [..., m, n], out in x's dtype."""
  product = product or symmetric_product

  def polynomial(xs, coeffs):  # xs [..., m, n] -> [..., m, m]
    a, b, c = coeffs
    m = xs.shape[-2]
    gram = product(xs.reshape((-1, m, xs.shape[-1])))
    return product(gram, gram, alpha=c, beta=b, gamma=a).reshape(xs.shape[:-1] + (m,))

  return standard_form(x, steps=steps, coeffs=coeffs, eps=eps, dtype=jnp.bfloat16,
                       polynomial=polynomial)

"""QK-Clip's max logit per head [H] fp32, no gradient, as the dense reference gives it: the
flash kernels keep no row maxima, so `max_logit` (a JAX tile loop) and `max_logit_gpu`
(Triton, maxima in registers) recompute q k^T."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.flash import _pad_rows, _round_up

MAX_LOGIT_BLOCK = 512
MAX_LOGIT_TILE_BYTES = 2**28   # bigger tiles while one fits: else many tiny kernels


def max_logit_block(b: int, h: int, t: int) -> int:
  """MAX_LOGIT_BLOCK doubled while a [b, h] fp32 tile fits MAX_LOGIT_TILE_BYTES and T."""
  block = MAX_LOGIT_BLOCK
  while 2 * block <= t and b * h * (2 * block) ** 2 * 4 <= MAX_LOGIT_TILE_BYTES:
    block *= 2
  return block


def max_logit(q: jax.Array, k: jax.Array, segment_ids: jax.Array, *, scale: float,
              causal: bool, q_offset=0, block: int | None = None) -> jax.Array:
  """q [B, Tq, H, Dqk] at q_offset (int or traced), k [B, T, H or 1, Dqk], segment_ids
  [B, T] -> [H]; one fp32 [B, H, block, block] tile live, none above the diagonal."""
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k.astype(q.dtype))
  b, tq, h, _ = q.shape
  t = k.shape[1]
  block = block or max_logit_block(b, h, t)
  bq, bk = min(block, tq), min(block, t)
  nq, nk = -(-tq // bq), -(-t // bk)
  tiles = lambda x, n, bs: _pad_rows(x, n * bs).reshape(b, n, bs, *x.shape[2:])  # noqa: E731
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, tq, axis=1)
  qt, sq = tiles(q, nq, bq), tiles(q_ids, nq, bq)
  kt, sk = tiles(k, nk, bk), tiles(segment_ids, nk, bk)

  def tile_max(i, j, m):
    qi, si = (jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False) for x in (qt, sq))
    kj, sj = (jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False) for x in (kt, sk))
    s = jnp.einsum("bthd,bshd->bhts", qi, kj, preferred_element_type=jnp.float32) * scale
    see = (si[:, :, None] == sj[:, None, :]) & (si != 0)[:, :, None]
    if causal:
      q_pos, k_pos = q_offset + i * bq + jnp.arange(bq), j * bk + jnp.arange(bk)
      see &= q_pos[:, None] >= k_pos[None, :]
    return jnp.maximum(m, jnp.max(jnp.where(see[:, None], s, -jnp.inf), axis=(0, 2, 3)))

  def row(i, m):
    last = jnp.minimum(nk, (q_offset + (i + 1) * bq - 1) // bk + 1) if causal else nk
    return jax.lax.fori_loop(0, last, functools.partial(tile_max, i), m)

  return jax.lax.fori_loop(0, nq, row, jnp.full((h,), -jnp.inf, jnp.float32))


def _pow2_pieces(d: int) -> list[int]:
  """d as powers of two, Triton's tile sides: 192 -> [128, 64]."""
  return [1 << b for b in reversed(range(d.bit_length())) if d >> b & 1]


def _row_max_kernel(*refs, pieces: int, block_k: int, causal: bool, scale: float):
  """A block of queries of one (row, head) -> its rows' max logit [block_q]."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  q_refs, k_refs = refs[:pieces], refs[pieces:2 * pieces]
  q_id_ref, k_id_ref, out_ref = refs[2 * pieces:]
  block_q = out_ref.shape[0]
  i = pl.program_id(0)
  qs = [r[...] for r in q_refs]
  q_ids = q_id_ref[...]
  q_pos = i * block_q + jnp.arange(block_q)

  def body(j, m):
    keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    s = functools.reduce(jnp.add, [pltriton.dot(q, r[keys, :], trans_b=True)
                                   for q, r in zip(qs, k_refs)])
    see = (q_ids[:, None] == k_id_ref[keys][None, :]) & (q_ids != 0)[:, None]
    if causal:
      see &= q_pos[:, None] >= j * block_k + jnp.arange(block_k)[None, :]
    return jnp.maximum(m, jnp.max(jnp.where(see, s, -jnp.inf), axis=1))

  n_k = k_id_ref.shape[0] // block_k
  last = jnp.minimum(n_k, ((i + 1) * block_q - 1) // block_k + 1) if causal else n_k
  m = jax.lax.fori_loop(0, last, body, jnp.full((block_q,), -jnp.inf, jnp.float32))
  out_ref[...] = m * scale   # scale > 0: max(s) * scale == max(s * scale), bit for bit


def max_logit_gpu(q: jax.Array, k: jax.Array, segment_ids: jax.Array, *, scale: float,
                  causal: bool, block_q: int = 128, block_k: int = 64, num_warps: int = 8,
                  num_stages: int = 2, interpret: bool = False) -> jax.Array:
  """`max_logit` (q_offset 0) as one Triton kernel; Dqk split into power-of-two pieces."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k.astype(q.dtype))
  b, t, h, d = q.shape
  if scale <= 0:
    raise ValueError(f"max_logit_gpu takes a positive softmax scale, got {scale}")
  block = max(block_q, block_k)
  t_p = _round_up(t, block)
  ids = _pad_rows(segment_ids, t_p)
  widths = _pow2_pieces(_round_up(d, 16))

  def split(x):
    x = jnp.pad(_pad_rows(x, t_p), [(0, 0)] * 3 + [(0, sum(widths) - d)])
    return [x[..., sum(widths[:n]):sum(widths[:n + 1])] for n in range(len(widths))]

  shared = k.shape[2] == 1
  q_specs = [pl.BlockSpec((None, block_q, None, w), lambda i, r, hd: (r, i, hd, 0))
             for w in widths]
  k_specs = [pl.BlockSpec((None, t_p, None, w),
                          (lambda i, r, hd: (r, 0, 0, 0)) if shared else
                          (lambda i, r, hd: (r, 0, hd, 0))) for w in widths]
  rows = pl.pallas_call(
      functools.partial(_row_max_kernel, pieces=len(widths), block_k=block_k, causal=causal,
                        scale=scale),
      grid=(t_p // block_q, b, h),
      in_specs=[*q_specs, *k_specs,
                pl.BlockSpec((None, block_q), lambda i, r, hd: (r, i)),
                pl.BlockSpec((None, t_p), lambda i, r, hd: (r, 0))],
      out_specs=pl.BlockSpec((None, None, block_q), lambda i, r, hd: (r, hd, i)),
      out_shape=jax.ShapeDtypeStruct((b, h, t_p), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
  )(*split(q), *split(k), ids, ids)
  return jnp.max(rows, axis=(0, 2))

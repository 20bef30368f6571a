"""QK-Clip's max logit: each head's largest pre-softmax logit over the real queries and the
keys they see, as the dense reference returns it ([H] fp32, no gradient). The flash kernels
do not return their row maxima, so q k^T is computed once more, tile by tile:

  `max_logit`      a JAX loop over [block, block] tiles (any platform; the TPU path and
                   context parallelism use it, with a traced query offset).
  `max_logit_gpu`  a Pallas Triton kernel: each program streams the key blocks past one
                   block of queries, keeping the row maxima in registers (the JAX loop
                   writes and rereads each fp32 tile).

Cost: the q k^T product once more, B H T^2 Dqk FLOPs causal (2 B H T^2 Dqk not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.flash import _pad_rows, _round_up

MAX_LOGIT_BLOCK = 512          # the smallest max-logit tile side
MAX_LOGIT_TILE_BYTES = 2**28   # larger tiles while one fp32 tile [B, H, block, block] fits:
                               # long rows of few heads otherwise run as many tiny kernels


def max_logit_block(b: int, h: int, t: int) -> int:
  """The max-logit tile side for B rows of H heads and T keys: MAX_LOGIT_BLOCK doubled while
  the fp32 tile stays within MAX_LOGIT_TILE_BYTES and below T."""
  block = MAX_LOGIT_BLOCK
  while 2 * block <= t and b * h * (2 * block) ** 2 * 4 <= MAX_LOGIT_TILE_BYTES:
    block *= 2
  return block


def max_logit(q: jax.Array, k: jax.Array, segment_ids: jax.Array, *, scale: float,
              causal: bool, q_offset=0, block: int | None = None) -> jax.Array:
  """Each head's largest pre-softmax logit over the real (segment != 0) queries and the
  keys they see, as the dense reference returns it: [H] fp32, no gradient.

  q: [B, Tq, H, Dqk], the queries at positions q_offset .. q_offset + Tq - 1 (an int or a
  traced scalar; default all T); k: [B, T, H or 1, Dqk]; segment_ids [B, T] (0 = padding).
  Loops over [block, block] tiles (skipping those above the diagonal when causal; block
  None: `max_logit_block`); live memory is one fp32 tile [B, H, block, block].
  """
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k.astype(q.dtype))
  b, tq, h, _ = q.shape
  t = k.shape[1]
  block = block or max_logit_block(b, h, t)
  bq, bk = min(block, tq), min(block, t)
  nq, nk = -(-tq // bq), -(-t // bk)
  tiles = lambda x, n, bs: _pad_rows(x, n * bs).reshape(b, n, bs, *x.shape[2:])  # noqa: E731
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, tq, axis=1)
  # padded rows get id 0: skipped
  qt, sq = tiles(q, nq, bq), tiles(q_ids, nq, bq)
  kt, sk = tiles(k, nk, bk), tiles(segment_ids, nk, bk)

  def tile_max(i, j, m):
    qi, si = (jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False) for x in (qt, sq))
    kj, sj = (jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False) for x in (kt, sk))
    s = jnp.einsum("bthd,bshd->bhts", qi, kj, preferred_element_type=jnp.float32) * scale
    see = (si[:, :, None] == sj[:, None, :]) & (si != 0)[:, :, None]    # [B, bq, bk]
    if causal:
      q_pos, k_pos = q_offset + i * bq + jnp.arange(bq), j * bk + jnp.arange(bk)
      see &= q_pos[:, None] >= k_pos[None, :]
    return jnp.maximum(m, jnp.max(jnp.where(see[:, None], s, -jnp.inf), axis=(0, 2, 3)))

  def row(i, m):
    # causal: the key tiles up to the one holding this tile's last query
    last = jnp.minimum(nk, (q_offset + (i + 1) * bq - 1) // bk + 1) if causal else nk
    return jax.lax.fori_loop(0, last, functools.partial(tile_max, i), m)

  return jax.lax.fori_loop(0, nq, row, jnp.full((h,), -jnp.inf, jnp.float32))


def _pow2_pieces(d: int) -> list[int]:
  """d (a multiple of 16) as a sum of decreasing powers of two >= 16, Triton's tile sides:
  192 -> [128, 64]."""
  return [1 << b for b in reversed(range(d.bit_length())) if d >> b & 1]


def _row_max_kernel(*refs, pieces: int, block_k: int, causal: bool, scale: float):
  """One block of queries of one (row, head) against the key blocks it may see -> its rows'
  max logit [block_q] (-inf where a row sees nothing: padding)."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  q_refs, k_refs = refs[:pieces], refs[pieces:2 * pieces]
  q_id_ref, k_id_ref, out_ref = refs[2 * pieces:]
  block_q = out_ref.shape[0]
  i = pl.program_id(0)
  qs = [r[...] for r in q_refs]                                  # [block_q, piece] each
  q_ids = q_id_ref[...]
  q_pos = i * block_q + jnp.arange(block_q)

  def body(j, m):
    keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    s = functools.reduce(jnp.add, [pltriton.dot(q, r[keys, :], trans_b=True)
                                   for q, r in zip(qs, k_refs)])  # [block_q, block_k] fp32
    see = (q_ids[:, None] == k_id_ref[keys][None, :]) & (q_ids != 0)[:, None]
    if causal:
      see &= q_pos[:, None] >= j * block_k + jnp.arange(block_k)[None, :]
    return jnp.maximum(m, jnp.max(jnp.where(see, s, -jnp.inf), axis=1))

  n_k = k_id_ref.shape[0] // block_k
  # causal: up to the key block holding this block's last query
  last = jnp.minimum(n_k, ((i + 1) * block_q - 1) // block_k + 1) if causal else n_k
  m = jax.lax.fori_loop(0, last, body, jnp.full((block_q,), -jnp.inf, jnp.float32))
  out_ref[...] = m * scale   # scale > 0: max(s) * scale == max(s * scale), bit for bit


def max_logit_gpu(q: jax.Array, k: jax.Array, segment_ids: jax.Array, *, scale: float,
                  causal: bool, block_q: int = 128, block_k: int = 64, num_warps: int = 8,
                  num_stages: int = 2, interpret: bool = False) -> jax.Array:
  """`max_logit` as one Pallas Triton kernel. q: [B, T, H, Dqk]; k: [B, T, H or 1, Dqk];
  segment_ids [B, T] (0 = padding). Dqk is zero-padded to a multiple of 16 and split into
  power-of-two pieces (192 = 128 + 64). -> [H] fp32, no gradient. interpret: Pallas interpret
  mode (any platform)."""
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k.astype(q.dtype))
  b, t, h, d = q.shape
  if scale <= 0:
    raise ValueError(f"max_logit_gpu takes a positive softmax scale, got {scale}")
  block = max(block_q, block_k)
  t_p = _round_up(t, block)
  ids = _pad_rows(segment_ids, t_p)          # padded rows: id 0, skipped
  widths = _pow2_pieces(_round_up(d, 16))    # zero columns past d add nothing to q k^T

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

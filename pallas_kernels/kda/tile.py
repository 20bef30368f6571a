"""Per-chunk KDA maths on 2-D tiles, shared by the Pallas kernels and their XLA backward.

`chunk_prep` turns one chunk of C tokens into everything the inter-chunk recurrence needs
(the UT transform included). It uses only 2-D ops that lower in a Pallas kernel body
(Triton, Mosaic TPU, interpret mode): matmuls, elementwise maps, masked reductions and
iotas; no reshapes, gathers or transposes. Run under `jax.vmap` it is also the XLA form
that the backward differentiates (`jax.vjp`), so the kernel and its gradient share one
definition of the maths.

Notation (K3_SPEC 2.1, as in `chunk.py`): G = cumulative log-decay inside the chunk and the
document, so for same-document t >= j the decay from j to t is e^{G_t - G_j}.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


_CONTRACT = {"nn": (1, 0), "nt": (1, 1), "tn": (0, 0)}


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, (((_CONTRACT[dims][0],), (_CONTRACT[dims][1],)), ((), ())),
                         precision=precision, preferred_element_type=F32)


def dot(a, b, dims, precision, dtype=None):
  """2-D matmul with fp32 accumulation. dims: 'nn' (a b), 'nt' (a b^T), 'tn' (a^T b).
  Operands are cast to `dtype` (float32 when None; bf16 runs the tensor cores' native
  product, `precision` then unused)."""
  dtype = dtype or F32
  if dtype == F32:
    return _dot(a.astype(F32), b.astype(F32), dims, precision)
  return _dot(a.astype(dtype), b.astype(dtype), dims, None)


def dot_ad(a, b, dims, precision, dtype=None):
  """`dot` whose low-precision products differentiate into float32 products at `precision`
  of the cotangent with the rounded operands (for code that is differentiated: a kernel
  body cannot hold the custom VJP itself, only its result under `jax.vjp`)."""
  dtype = dtype or F32
  if dtype == F32:
    return dot(a, b, dims, precision)
  return _dot_low(a, b, dims, precision, jnp.dtype(dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dot_low(a, b, dims, precision, dtype):
  return _dot(a.astype(dtype), b.astype(dtype), dims, None)


def _dot_low_fwd(a, b, dims, precision, dtype):
  a, b = a.astype(dtype), b.astype(dtype)
  return _dot(a, b, dims, None), (a, b)


def _dot_low_bwd(dims, precision, dtype, res, ct):
  # (XLA's own transpose would multiply a float32 cotangent by a bf16 operand: a mixed
  # product that Triton does not take)
  a, b = (x.astype(F32) for x in res)
  if dims == "nn":  # a [m, k], b [k, n]
    da, db = _dot(ct, b, "nt", precision), _dot(a, ct, "tn", precision)
  elif dims == "nt":  # a [m, k], b [n, k]
    da, db = _dot(ct, b, "nn", precision), _dot(ct, a, "tn", precision)
  else:  # "tn": a [k, m], b [k, n]
    da, db = _dot(b, ct, "nt", precision), _dot(a, ct, "nn", precision)
  return da, db


_dot_low.defvjp(_dot_low_fwd, _dot_low_bwd)


def invert_unit_lower(a, precision):
  """(I + a)^-1 for strictly lower-triangular a [C, C], C a power of two.

  Block doubling with masks instead of slices: if x inverts the s x s diagonal blocks,
  x - x m x inverts the 2s x 2s ones, where m keeps a's lower-left s-block inside each
  2s-block. log2(C) steps of two matmuls each.
  """
  C = a.shape[0]
  t = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  x = (t == j).astype(F32)
  s = 1
  while s < C:  # (shifts and masks, not // and %: s is a power of two; Mosaic-friendly)
    lower_left = ((t & s) != 0) & ((j & s) == 0) & ((t & -2 * s) == (j & -2 * s))
    x = x - dot(dot(x, jnp.where(lower_left, a, 0.0), "nn", precision), x, "nn", precision)
    s *= 2
  return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def invert_unit_lower_ad(a, precision):
  """`invert_unit_lower` with the analytic gradient d a = -X^T dX X^T (for the XLA form:
  differentiating through the doubling would keep every step's [C, C] products)."""
  return invert_unit_lower(a, precision)


def _inv_fwd(a, precision):
  x = invert_unit_lower(a, precision)
  return x, x


def _inv_bwd(precision, x, dx):
  # 2-D products only (no transposes), so that the backward kernel's body can hold it too
  return (-dot(dot(x, dx, "tn", precision), x, "nt", precision),)


invert_unit_lower_ad.defvjp(_inv_fwd, _inv_bwd)


def chunk_prep(q, k, v, g, beta, doc_c, doc_r, sees, last, *, scale, sub, mm_dtype, precision,
               in_kernel=True):
  """One chunk's intra-chunk work: decays, scores, the UT transform.

  Args:
    q, k, g: [C, K] (g is the log-decay, LOWER_BOUND <= g <= 0).
    v: [C, V].
    beta: [C, 1].
    doc_c, doc_r: [C, 1] and [1, C] int32, the document index of each token (twice, so that
      no transpose is needed).
    sees: [C, 1] float, 1 where the token belongs to the document of the incoming state.
    last: [C, 1] float, 1 where the token belongs to the chunk's last document.
    scale: multiplies q.
    sub: diagonal sub-tile length L, a power of two dividing C; decays inside a tile reach
      e^{5 (L - 1)}.
    mm_dtype: operand dtype of the score matmuls (bf16 for bf16 inputs, else float32).
    precision: precision of the float32 matmuls (cumulative sums, inverse, UT products).
    in_kernel: False when the result is differentiated (the XLA form, the backward
      kernel): the inverse then gets its analytic gradient.

  Returns (float32):
    w [C, K]: (I + A_kk)^-1 (beta k e^G) for state-seeing tokens; v_new = u - w S.
    u [C, V]: (I + A_kk)^-1 (beta v).
    a_qk [C, C]: causal same-document scores, decay included (diagonal q_t . k_t).
    q_s [C, K]: scale q e^G for state-seeing tokens; o = q_s S + a_qk v_new.
    k_s [C, K]: k e^{G_last - G} in the last document; S <- dec S + k_s^T v_new.
    dec [1, K]: e^{G_last}, or 0 if the chunk's last document starts inside the chunk.
  """
  C = q.shape[0]
  q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
  q = scale * q
  t = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  tc = lax.broadcasted_iota(jnp.int32, (C, 1), 0)  # token index as a column
  same = doc_c == doc_r  # [C, C]
  causal = same & (t >= j)
  strict = same & (t > j)
  exact = lambda m, x: dot(m.astype(F32), x, "nn", precision)  # masked sums, fp32
  # Decays as masked sums, never differences of cumulative sums: no rounding reaches the
  # gradient of an earlier document, nor of g where the decay is ~1 (as in chunk.py).
  G = exact(causal, g)  # [C, K], sum over same-document j <= t
  to_end = exact(same & (t < j), g)  # [C, K], sum over same-document j > t
  # Diagonal tiles take the reference r(t) = max(tile start, document start); e_t =
  # G_t - G_r(t) in [LOWER_BOUND (L - 1), 0]. A same-document j is r(t) iff it starts its
  # document or its tile; so the sum runs over j in (r(t), t].
  is_start = jnp.sum((same & (t <= j)).astype(F32), axis=0, keepdims=True) == 1.0  # [1, C]
  span = causal & (j > (t & -sub)) & ~is_start  # t & -sub: t's tile start (sub = 2^n)
  e = exact(span, g)

  def mm(a, b, dims):
    return (dot if in_kernel else dot_ad)(a, b, dims, precision, mm_dtype)

  same_tile = (t & -sub) == (j & -sub)
  k_diag = k * jnp.exp(-e)  # <= e^{75} for L = 16

  def scores(x):  # [C, K] -> [C, C]: sum_c x_tc k_jc e^{G_tc - G_jc}, valid for t > j
    acc = jnp.where(same_tile, mm(x * jnp.exp(e), k_diag, "nt"), 0.0)
    for b in range(C // sub - 1):  # column tiles with a tile after them
      end = b * sub + sub - 1
      at_end = tc == end
      g_end = jnp.sum(jnp.where(at_end, G, 0.0), axis=0, keepdims=True)  # [1, K]
      doc_end = jnp.sum(jnp.where(at_end, doc_c, 0), axis=0, keepdims=True)  # [1, 1]
      # Reference: G at the tile's last token, between every such pair, so both factors
      # are <= 1; rows before the tile or outside the reference's document are masked.
      row_ok = (tc > end) & (doc_c == doc_end)  # [C, 1]
      col_ok = ((tc & -sub) == b * sub) & (doc_c == doc_end)
      row = x * jnp.exp(jnp.where(row_ok, G - g_end, -jnp.inf))
      col = k * jnp.exp(jnp.where(col_ok, g_end - G, -jnp.inf))
      acc = acc + mm(row, col, "nt")
    return acc

  qk = jnp.sum(q * k, axis=1, keepdims=True)  # [C, 1]; the diagonal decays by exactly 1
  a_qk = jnp.where(strict, scores(q), jnp.where(t == j, qk, 0.0))
  a_kk = jnp.where(strict, beta * scores(k), 0.0)
  inv = invert_unit_lower(a_kk, precision) if in_kernel else invert_unit_lower_ad(a_kk,
                                                                                  precision)
  decay = jnp.exp(G)
  w = dot(inv, beta * sees * k * decay, "nn", precision)
  u = dot(inv, beta * v, "nn", precision)
  q_s = sees * q * decay
  k_s = last * k * jnp.exp(to_end)
  at_last = tc == C - 1
  g_last = jnp.sum(jnp.where(at_last, G, 0.0), axis=0, keepdims=True)  # [1, K]
  sees_last = jnp.sum(jnp.where(at_last, sees, 0.0), axis=0, keepdims=True)  # [1, 1]
  dec = sees_last * jnp.exp(g_last)
  return w, u, a_qk, q_s, k_s, dec

"""Per-chunk KDA maths on 2-D tiles (`chunk.py`'s notation): `chunk_prep` and its hand-derived
vjp, the Pallas kernels' bodies. Only ops every Pallas backend lowers: 2-D matmuls,
elementwise maps, masked reductions, iotas; no reshapes, gathers or transposes."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


_CONTRACT = {"nn": (1, 0), "nt": (1, 1), "tn": (0, 0)}


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, (((_CONTRACT[dims][0],), (_CONTRACT[dims][1],)), ((), ())),
                         precision=precision, preferred_element_type=F32)


def dot(a, b, dims, precision, dtype=None):
  """2-D matmul, fp32 accumulation; dims 'nn' (a b), 'nt' (a b^T), 'tn' (a^T b). Operands
  in `dtype` (None: fp32 at `precision`; bf16 ignores `precision`)."""
  dtype = dtype or F32
  if dtype == F32:
    return _dot(a.astype(F32), b.astype(F32), dims, precision)
  return _dot(a.astype(dtype), b.astype(dtype), dims, None)


def invert_unit_lower(a, precision):
  """(I + a)^-1, a [C, C] strictly lower, C a power of two: if x inverts the s-blocks,
  x - x m x inverts the 2s-blocks (m: a's lower-left s-block in each 2s-block)."""
  C = a.shape[0]
  t = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  x = (t == j).astype(F32)
  s = 1
  while s < C:
    lower_left = ((t & s) != 0) & ((j & s) == 0) & ((t & -2 * s) == (j & -2 * s))
    x = x - dot(dot(x, jnp.where(lower_left, a, 0.0), "nn", precision), x, "nn", precision)
    s *= 2
  return x


class _Frame:
  """Masks and cumulative decays of one chunk (shared by `chunk_prep` and its backward)."""

  def __init__(self, g, doc_c, doc_r, sub, precision, bounded):
    C = g.shape[0]
    t = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    self.t, self.j = t, j
    self.tc = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    self.g, self.doc_c, self.doc_r = g, doc_c, doc_r
    same = doc_c == doc_r
    self.diag = t == j
    self.causal = same & (t >= j)
    self.strict = same & (t > j)
    self.after = same & (t < j)
    self.same_tile = (t & -sub) == (j & -sub)
    self.sub, self.precision, self.bounded = sub, precision, bounded
    self.G = self.masked_sum(self.causal, g)
    self.to_end = self.masked_sum(self.after, g)
    if bounded:
      # Masked sums, not cumsum differences (as chunk.py); e_t = G_t - G_r(t), summed over
      # j in (r(t), t] for r(t) = max(tile start, document start).
      is_start = jnp.sum((same & (t <= j)).astype(F32), axis=0, keepdims=True) == 1.0
      self.span = self.causal & (j > (t & -sub)) & ~is_start
      self.e = self.masked_sum(self.span, g)
    self.tile_parts = self._tile_parts(C)

  def masked_sum(self, mask, x):
    """sum_j mask[t, j] x[j], fp32 at the kernel's precision."""
    return dot(mask.astype(F32), x, "nn", self.precision)

  def pair_part(self, jj):
    """Diagonal tiles' column jj: f_t = e^{G_t - G_s}, s = t's tile start + jj; h = 1."""
    ref = (self.t & -self.sub) + jj
    column = self.j == ref
    doc_ref = jnp.sum(jnp.where(column, self.doc_r, 0), axis=1, keepdims=True)
    ok = (self.tc - (self.tc & -self.sub) >= jj) & (self.doc_c == doc_ref)
    span = ok & (self.j > ref) & (self.j <= self.t)
    f = jnp.exp(jnp.where(ok, self.masked_sum(span, self.g), -jnp.inf))
    return f, 1.0, column, None, span

  def score_parts(self):
    """scores(x) = sum over parts (f, h, mask, at_end, span) of mask * ((x f) (k h)^T): the
    diagonal tiles' (e^e, e^-e), or (unbounded gate) their `pair_part`s, made at each use
    so their factors are not all live at once; then per column tile with a tile after it
    (e^{G - G_end}, e^{G_end - G}), G_end at its last token (`at_end` [C, 1])."""
    if self.bounded:
      return self.tile_parts
    return itertools.chain((self.pair_part(jj) for jj in range(self.sub)), self.tile_parts)

  def _tile_parts(self, C):
    sub, G, tc, doc_c = self.sub, self.G, self.tc, self.doc_c
    parts = []
    if self.bounded:
      parts.append((jnp.exp(self.e), jnp.exp(-self.e), self.same_tile, None, None))
    for b in range(C // sub - 1):
      end = b * sub + sub - 1
      at_end = tc == end
      g_end = jnp.sum(jnp.where(at_end, G, 0.0), axis=0, keepdims=True)
      doc_end = jnp.sum(jnp.where(at_end, doc_c, 0), axis=0, keepdims=True)
      row_ok = (tc > end) & (doc_c == doc_end)
      col_ok = ((tc & -sub) == b * sub) & (doc_c == doc_end)
      parts.append((jnp.exp(jnp.where(row_ok, G - g_end, -jnp.inf)),
                    jnp.exp(jnp.where(col_ok, g_end - G, -jnp.inf)), None, at_end, None))
    return parts


def _scores(x, k, fr, mm):
  acc = 0.0
  for f, h, mask, *_ in fr.score_parts():
    p = mm(x * f, k * h, "nt")
    acc = acc + (p if mask is None else jnp.where(mask, p, 0.0))
  return acc


def _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype, precision,
             bounded, inverse=None):
  mm = lambda a, b, dims: dot(a, b, dims, precision, mm_dtype)
  C = q.shape[0]
  q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
  q = scale * q
  fr = _Frame(g, doc_c, doc_r, sub, precision, bounded)
  qk = jnp.sum(q * k, axis=1, keepdims=True)
  a_qk = jnp.where(fr.strict, _scores(q, k, fr, mm), jnp.where(fr.diag, qk, 0.0))
  if inverse is None:
    s_kk = _scores(k, k, fr, mm)
    inv = invert_unit_lower(jnp.where(fr.strict, beta * s_kk, 0.0), precision)
  else:
    inv, s_kk = (x.astype(F32) for x in inverse)
  decay = jnp.exp(fr.G)
  x_w, bv = beta * sees * k * decay, beta * v
  w = dot(inv, x_w, "nn", precision)
  u = dot(inv, bv, "nn", precision)
  q_s = sees * q * decay
  k_s = last * k * jnp.exp(fr.to_end)
  at_last = fr.tc == C - 1
  g_last = jnp.sum(jnp.where(at_last, fr.G, 0.0), axis=0, keepdims=True)
  sees_last = jnp.sum(jnp.where(at_last, sees, 0.0), axis=0, keepdims=True)
  dec = sees_last * jnp.exp(g_last)
  saved = dict(fr=fr, q=q, k=k, v=v, beta=beta, sees=sees, last=last, s_kk=s_kk,
               inv=inv, decay=decay, x_w=x_w, bv=bv, q_s=q_s, at_last=at_last, dec=dec)
  return (w, u, a_qk, q_s, k_s, dec), saved


def chunk_prep(q, k, v, g, beta, doc_c, doc_r, sees, last, *, scale, sub, mm_dtype, precision,
               bounded=True, with_inverse=False):
  """One chunk: q, k, g [C, K]; v [C, V]; beta, sees (in the entering state's document),
  last (in the chunk's last one) [C, 1]; doc_c [C, 1], doc_r [1, C] document index;
  bounded: g >= LOWER_BOUND, else any g <= 0. Returns
  fp32 w, q_s, k_s [C, K], u [C, V], a_qk [C, C], dec [1, K] with v_new = u - w S,
  o = q_s S + a_qk v_new, S <- dec S + k_s^T v_new; with_inverse: then also the UT
  transform's (I + A_kk)^-1 and k's scores s_kk [C, C], `chunk_prep_vjp`'s inverse."""
  outs, sv = _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype,
                      precision, bounded)
  return (*outs, sv["inv"], sv["s_kk"]) if with_inverse else outs


def chunk_prep_vjp(q, k, v, g, beta, doc_c, doc_r, sees, last, *, scale, sub, mm_dtype,
                   precision, bounded=True, inverse=None):
  """(`chunk_prep`'s outputs, vjp(dw, du, da, dq_s, dk_s, ddec) -> fp32 dq, dk, dv, dg,
  dbeta), the forward recomputed; inverse: (inv, s_kk) from `chunk_prep(with_inverse=True)`,
  taken instead of recomputed (the inverse is a chain of dependent products). Score
  gradients take the fp32 operands, not the mm_dtype ones: dg = d log f - d log h cancels,
  and bf16 rounding would dominate it."""
  outs, sv = _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype,
                      precision, bounded, inverse)
  fr, q, k, inv = sv["fr"], sv["q"], sv["k"], sv["inv"]
  beta, sees, decay = sv["beta"], sv["sees"], sv["decay"]

  def vjp(dw, du, da, dqs, dks, ddec):
    dw, du, da, dqs, dks, ddec = (x.astype(F32) for x in (dw, du, da, dqs, dks, ddec))
    # the UT transform: d inv = dw x_w^T + du bv^T, d A_kk = -inv^T (d inv) inv^T
    dx_w = dot(inv, dw, "tn", precision)
    dbv = dot(inv, du, "tn", precision)
    d_inv = dot(dw, sv["x_w"], "nt", precision) + dot(du, sv["bv"], "nt", precision)
    da_kk = -dot(dot(inv, d_inv, "tn", precision), inv, "nt", precision)
    da_kk = jnp.where(fr.strict, da_kk, 0.0)
    dv = beta * dbv
    dbeta = (jnp.sum(sv["v"] * dbv, axis=1, keepdims=True)
             + jnp.sum(sees * k * decay * dx_w, axis=1, keepdims=True)
             + jnp.sum(da_kk * sv["s_kk"], axis=1, keepdims=True))
    dk = beta * sees * decay * dx_w
    dG = sv["x_w"] * dx_w
    dq = sees * decay * dqs
    dG = dG + sv["q_s"] * dqs
    k_end = jnp.exp(fr.to_end)
    dk = dk + sv["last"] * k_end * dks
    d_to_end = sv["last"] * k * k_end * dks
    dG = dG + jnp.where(sv["at_last"], sv["dec"] * ddec, 0.0)
    dqk = jnp.sum(jnp.where(fr.diag, da, 0.0), axis=1, keepdims=True)
    dq = dq + dqk * k
    dk = dk + dqk * q
    sum_t = lambda mask, x: dot(mask.astype(F32), x, "tn", precision)
    de = dg_pairs = 0.0
    for x, d_scores, is_q in ((q, jnp.where(fr.strict, da, 0.0), True),
                              (k, beta * da_kk, False)):
      for f, h, mask, at_end, span in fr.score_parts():
        d_p = d_scores if mask is None else jnp.where(mask, d_scores, 0.0)
        lhs, rhs = x * f, k * h
        d_lhs = dot(d_p, rhs, "nn", precision)
        d_rhs = dot(d_p, lhs, "tn", precision)
        if is_q:
          dq = dq + f * d_lhs
        else:
          dk = dk + f * d_lhs
        dk = dk + h * d_rhs
        if span is not None:  # f = e^{sum over span of g}, h = 1
          dg_pairs = dg_pairs + sum_t(span, lhs * d_lhs)
          continue
        d_log = lhs * d_lhs - rhs * d_rhs
        if at_end is None:
          de = de + d_log
        else:
          dG = dG + d_log - jnp.where(at_end, jnp.sum(d_log, axis=0, keepdims=True), 0.0)
    dg = sum_t(fr.causal, dG) + sum_t(fr.after, d_to_end) + dg_pairs
    if fr.bounded:
      dg = dg + sum_t(fr.span, de)
    return scale * dq, dk, dv, dg, dbeta

  return outs, vjp

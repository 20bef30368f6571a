"""Per-chunk KDA maths on 2-D tiles, the bodies of the Pallas kernels.

`chunk_prep` turns one chunk of C tokens into everything the inter-chunk recurrence needs
(the UT transform included); `chunk_prep_vjp` recomputes it and gives its vjp, derived by
hand (tests/test_kda_kernel.py holds it to `jax.vjp` of `chunk_prep`). Both use only 2-D
ops that lower in a Pallas kernel body (Triton, Mosaic TPU, interpret mode): matmuls,
elementwise maps, masked reductions and iotas; no reshapes, gathers or transposes.

Notation (K3_SPEC 2.1, as in `chunk.py`): G = cumulative log-decay inside the chunk and the
document, so for same-document t >= j the decay from j to t is e^{G_t - G_j}.
"""

from __future__ import annotations

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


class _Frame:
  """Masks and cumulative decays of one chunk (shared by `chunk_prep` and its backward)."""

  def __init__(self, g, doc_c, doc_r, sub, precision):
    C = g.shape[0]
    t = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    self.tc = lax.broadcasted_iota(jnp.int32, (C, 1), 0)  # token index as a column
    self.doc_c = doc_c
    same = doc_c == doc_r  # [C, C]
    self.diag = t == j
    self.causal = same & (t >= j)
    self.strict = same & (t > j)
    self.after = same & (t < j)
    # Decays as masked sums, never differences of cumulative sums: no rounding reaches the
    # gradient of an earlier document, nor of g where the decay is ~1 (as in chunk.py).
    # Diagonal tiles take the reference r(t) = max(tile start, document start); e_t =
    # G_t - G_r(t) in [LOWER_BOUND (L - 1), 0]. A same-document j is r(t) iff it starts its
    # document or its tile; so the sum runs over j in (r(t), t].
    is_start = jnp.sum((same & (t <= j)).astype(F32), axis=0, keepdims=True) == 1.0  # [1, C]
    self.span = self.causal & (j > (t & -sub)) & ~is_start  # t & -sub: t's tile start
    self.same_tile = (t & -sub) == (j & -sub)
    self.sub, self.precision = sub, precision
    self.G = self.masked_sum(self.causal, g)  # [C, K], sum over same-document j <= t
    self.to_end = self.masked_sum(self.after, g)  # [C, K], sum over same-document j > t
    self.e = self.masked_sum(self.span, g)

  def masked_sum(self, mask, x):
    """[C, C] mask, [C, d] x -> sum_j mask[t, j] x[j] in float32 at the kernel's precision
    (on the H200 single-pass TF32 left the errors of an fp32 gate unchanged:
    benchmarks/results/kda.md)."""
    return dot(mask.astype(F32), x, "nn", self.precision)

  def score_parts(self, k):
    """Factors of the causal score products: scores(x) [C, C] = sum over the parts
    (f, h, mask, at_end) of mask * ((x f) (k h)^T), each factor <= e^{|LOWER_BOUND| (L - 1)}.
    The diagonal tiles' part has f = e^e, h = e^-e and a mask; one part per column tile
    with a tile after it has f = e^{G - G_end}, h = e^{G_end - G} (G_end: G at the tile's
    last token, `at_end` [C, 1] marks it) on the rows after / columns inside the tile, in the
    reference's document, and no mask."""
    C, sub, G, tc, doc_c = k.shape[0], self.sub, self.G, self.tc, self.doc_c
    parts = [(jnp.exp(self.e), jnp.exp(-self.e), self.same_tile, None)]
    for b in range(C // sub - 1):  # column tiles with a tile after them
      end = b * sub + sub - 1
      at_end = tc == end
      g_end = jnp.sum(jnp.where(at_end, G, 0.0), axis=0, keepdims=True)  # [1, K]
      doc_end = jnp.sum(jnp.where(at_end, doc_c, 0), axis=0, keepdims=True)  # [1, 1]
      # rows before the tile or outside the reference's document are masked
      row_ok = (tc > end) & (doc_c == doc_end)  # [C, 1]
      col_ok = ((tc & -sub) == b * sub) & (doc_c == doc_end)
      parts.append((jnp.exp(jnp.where(row_ok, G - g_end, -jnp.inf)),
                    jnp.exp(jnp.where(col_ok, g_end - G, -jnp.inf)), None, at_end))
    return parts


def _scores(x, k, parts, mm):
  acc = 0.0
  for f, h, mask, _ in parts:
    p = mm(x * f, k * h, "nt")
    acc = acc + (p if mask is None else jnp.where(mask, p, 0.0))
  return acc


def _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype, precision):
  """`chunk_prep`'s outputs, and what its backward reuses."""
  mm = lambda a, b, dims: dot(a, b, dims, precision, mm_dtype)
  C = q.shape[0]
  q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
  q = scale * q
  fr = _Frame(g, doc_c, doc_r, sub, precision)
  parts = fr.score_parts(k)
  qk = jnp.sum(q * k, axis=1, keepdims=True)  # [C, 1]; the diagonal decays by exactly 1
  a_qk = jnp.where(fr.strict, _scores(q, k, parts, mm), jnp.where(fr.diag, qk, 0.0))
  s_kk = _scores(k, k, parts, mm)
  inv = invert_unit_lower(jnp.where(fr.strict, beta * s_kk, 0.0), precision)
  decay = jnp.exp(fr.G)
  x_w, bv = beta * sees * k * decay, beta * v  # w = inv x_w, u = inv bv
  w = dot(inv, x_w, "nn", precision)
  u = dot(inv, bv, "nn", precision)
  q_s = sees * q * decay
  k_s = last * k * jnp.exp(fr.to_end)
  at_last = fr.tc == C - 1
  g_last = jnp.sum(jnp.where(at_last, fr.G, 0.0), axis=0, keepdims=True)  # [1, K]
  sees_last = jnp.sum(jnp.where(at_last, sees, 0.0), axis=0, keepdims=True)  # [1, 1]
  dec = sees_last * jnp.exp(g_last)
  saved = dict(fr=fr, parts=parts, q=q, k=k, v=v, beta=beta, sees=sees, last=last, s_kk=s_kk,
               inv=inv, decay=decay, x_w=x_w, bv=bv, q_s=q_s, at_last=at_last, dec=dec)
  return (w, u, a_qk, q_s, k_s, dec), saved


def chunk_prep(q, k, v, g, beta, doc_c, doc_r, sees, last, *, scale, sub, mm_dtype, precision):
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

  Returns (float32):
    w [C, K]: (I + A_kk)^-1 (beta k e^G) for state-seeing tokens; v_new = u - w S.
    u [C, V]: (I + A_kk)^-1 (beta v).
    a_qk [C, C]: causal same-document scores, decay included (diagonal q_t . k_t).
    q_s [C, K]: scale q e^G for state-seeing tokens; o = q_s S + a_qk v_new.
    k_s [C, K]: k e^{G_last - G} in the last document; S <- dec S + k_s^T v_new.
    dec [1, K]: e^{G_last}, or 0 if the chunk's last document starts inside the chunk.
  """
  outs, _ = _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype,
                     precision)
  return outs


def chunk_prep_vjp(q, k, v, g, beta, doc_c, doc_r, sees, last, *, scale, sub, mm_dtype,
                   precision):
  """`chunk_prep`'s outputs and their vjp, derived by hand (what a kernel runs: the forward
  recomputed in registers, no residuals stored).

  Returns (outputs, vjp): `vjp(dw, du, da, dq_s, dk_s, ddec)` (the cotangents of the six
  outputs) gives float32 dq, dk [C, K], dv [C, V], dg [C, K], dbeta [C, 1]. The score
  products' gradients multiply the float32 cotangent by the float32 operands (products at
  `precision`), not by the operands rounded to mm_dtype that the forward's products took:
  the gate's gradient is a difference of the two sides (d log f - d log h), which bf16
  rounding left much further from the fp32 reference than dq
  (test_kda_kernel.test_bf16_gate_gradient_is_as_accurate_as_the_others;
  benchmarks/results/kda.md).
  """
  outs, sv = _forward(q, k, v, g, beta, doc_c, doc_r, sees, last, scale, sub, mm_dtype,
                      precision)
  fr, parts, q, k, inv = sv["fr"], sv["parts"], sv["q"], sv["k"], sv["inv"]
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
    # q_s, k_s, dec
    dq = sees * decay * dqs
    dG = dG + sv["q_s"] * dqs
    k_end = jnp.exp(fr.to_end)
    dk = dk + sv["last"] * k_end * dks
    d_to_end = sv["last"] * k * k_end * dks
    dG = dG + jnp.where(sv["at_last"], sv["dec"] * ddec, 0.0)
    # A_qk's diagonal q_t . k_t
    dqk = jnp.sum(jnp.where(fr.diag, da, 0.0), axis=1, keepdims=True)
    dq = dq + dqk * k
    dk = dk + dqk * q
    # the score products: A_qk = scores(q) below the diagonal, A_kk = beta scores(k)
    de = 0.0
    for x, d_scores, is_q in ((q, jnp.where(fr.strict, da, 0.0), True),
                              (k, beta * da_kk, False)):
      for f, h, mask, at_end in parts:
        d_p = d_scores if mask is None else jnp.where(mask, d_scores, 0.0)
        lhs, rhs = x * f, k * h
        d_lhs = dot(d_p, rhs, "nn", precision)  # [C, K]
        d_rhs = dot(d_p, lhs, "tn", precision)
        if is_q:
          dq = dq + f * d_lhs
        else:
          dk = dk + f * d_lhs
        dk = dk + h * d_rhs
        d_log = lhs * d_lhs - rhs * d_rhs  # d log f - d log h (f, h: e^{+-one exponent})
        if at_end is None:
          de = de + d_log
        else:  # f = e^{G - G_end} on rows, h = e^{G_end - G} on columns
          dG = dG + d_log - jnp.where(at_end, jnp.sum(d_log, axis=0, keepdims=True), 0.0)
    sum_t = lambda mask, x: dot(mask.astype(F32), x, "tn", precision)  # masked, transposed
    dg = sum_t(fr.causal, dG) + sum_t(fr.span, de) + sum_t(fr.after, d_to_end)
    return scale * dq, dk, dv, dg, dbeta

  return outs, vjp

"""Chunkwise Kimi Delta Attention in plain JAX (K3_SPEC 2.1, "Chunkwise form").

Same maths as `naive.kda_naive`, reorganized so almost all work is matmuls over chunks of
C tokens: within a chunk the delta rule is solved in closed form (the UT transform), and
only the [K, V] state is carried from chunk to chunk by a `lax.scan`. All arithmetic is in
float32; bf16 inputs are upcast. Differentiable by plain autodiff.

Per chunk, with G the cumulative log-decay inside the chunk ([C, K]) and S the carried state:
    A_kk = StrictTril(diag(beta) (K e^G)(K e^-G)^T)        scores among keys
    [u, w] = (I + A_kk)^-1 [beta V, beta K e^G]              the UT transform
    v_new = u - w S                                          delta-rule residuals
    o = (scale Q e^G) S + Tril((scale Q e^G)(K e^-G)^T) v_new
    S <- e^{G_last} S + (K e^{G_last - G})^T v_new

Gate bound: the chunked form assumes LOWER_BOUND <= g <= 0 (K3's bounded gate,
g = -5 sigmoid(...)). It never forms e^{G_t - G_j} for a pair (t, j) directly (that would be
a [C, C, K] tensor); it splits it into a row factor and a column factor, each one matmul
operand. Inside a diagonal sub-chunk of L = sub_chunk_size tokens both factors stay within
e^{+-|LOWER_BOUND| (L - 1)} (e^75 for L = 16); below the diagonal the reference is a block
boundary between t and j, so both factors are <= 1. A gate below the bound can overflow.

Memory: the largest intermediates are the row factors below the diagonal, C / L times the
size of q ([B, H, T / C, C / L, C, K] float32, 4x q at the defaults); nothing is [C, C, K].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOWER_BOUND = -5.0  # K3's bounded gate: g in (LOWER_BOUND, 0)
_MAX_EXPONENT = 80.0  # e^80 ~ 5.5e34, with room below float32's max (~e^88.7)
_HI = jax.lax.Precision.HIGHEST


def check_sub_chunk(sub_chunk_size: int):
  """ValueError unless decays across a diagonal tile of this length stay in float32's range
  under the gate bound: |LOWER_BOUND| (L - 1) <= _MAX_EXPONENT."""
  if -LOWER_BOUND * (sub_chunk_size - 1) > _MAX_EXPONENT:
    raise ValueError(f"sub_chunk_size={sub_chunk_size} is too long for the gate bound "
                     f"{LOWER_BOUND}: decays over one tile would overflow float32")


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
              output_final_state=False, chunk_size=64, sub_chunk_size=16):
  """Chunkwise KDA; same contract as `kda_naive`, for any T.

  Args:
    q, k: [B, T, H, K]. (L2 normalization, if any, is the caller's job.)
    v: [B, T, H, V].
    g: [B, T, H, K] log-decay with LOWER_BOUND <= g <= 0 (see the module docstring).
    beta: [B, T, H].
    scale: multiplies q; defaults to K ** -0.5.
    initial_state: [B, H, K, V] or None (zeros). Applies to the first document only.
    segment_ids: [B, T] int or None. Each contiguous run of equal ids is one document;
      no information crosses a document boundary.
    output_final_state: also return the state after the last token.
    chunk_size: tokens per chunk (C); T is padded inside to a multiple of it.
    sub_chunk_size: diagonal tile length L; C % L == 0 and |LOWER_BOUND| (L - 1) <= 80.

  Returns:
    o [B, T, H, V] in q's dtype, and the final state [B, H, K, V] float32 if requested.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  if chunk_size % sub_chunk_size:
    raise ValueError(f"chunk_size={chunk_size} is not a multiple of "
                     f"sub_chunk_size={sub_chunk_size}")
  check_sub_chunk(sub_chunk_size)
  if scale is None:
    scale = K ** -0.5
  out_dtype = q.dtype
  C = chunk_size
  pad = -T % C
  N = (T + pad) // C
  f32 = jnp.float32

  def chunked(x):  # [B, T, H, ...] -> [B, H, N, C, ...] float32
    # Zero padding leaves the state unchanged: g = 0 (no decay), beta = 0 (no write).
    x = jnp.asarray(x, f32)
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, N, C, *x.shape[2:]), 3, 1)

  q, k, v, g, beta = map(chunked, (q, k, v, g, beta))  # [B, H, N, C, K|V], beta [B, H, N, C]
  doc = _document_index(segment_ids, B, T)
  doc = jnp.pad(doc, [(0, 0), (0, pad)], mode="edge")  # padding joins the last document
  doc = doc.reshape(B, 1, N, C)  # broadcasts over heads

  pos = jnp.arange(C)
  same_doc = doc[..., :, None] == doc[..., None, :]  # [B, 1, N, C, C]
  causal = same_doc & (pos[:, None] >= pos[None, :])
  # Cumulative log-decay within chunk and document, as a masked sum so that no gradient
  # (not even rounding noise) reaches an earlier document.
  G = jnp.matmul(causal.astype(f32), g, precision=_HI)  # [B, H, N, C, K]

  A_qk, A_kk = _intra_chunk_scores(scale * q, k, g, G, doc, causal, sub_chunk_size)
  A_kk = beta[..., None] * A_kk  # [B, H, N, C, C]

  # The state entering a chunk belongs to the document of the token before the chunk
  # (the initial state to the first document); other tokens must not see it.
  doc_state = jnp.concatenate([doc[..., :1, 0], doc[..., :-1, -1]], axis=-1)  # [B, 1, N]
  sees_state = (doc == doc_state[..., None]).astype(f32)  # [B, 1, N, C]
  decay = jnp.exp(G)  # [B, H, N, C, K], <= 1
  rhs = jnp.concatenate([beta[..., None] * v,
                         (beta * sees_state)[..., None] * k * decay], axis=-1)
  uw = jnp.matmul(_invert_unit_lower(A_kk), rhs, precision=_HI)  # (I + A_kk)^-1 rhs
  u, w = uw[..., :V], uw[..., V:]  # [B, H, N, C, V], [B, H, N, C, K]
  q_state = (scale * sees_state)[..., None] * q * decay  # [B, H, N, C, K]

  # Only the chunk's last document writes the outgoing state. Its decay to the chunk end,
  # G_last - G_t, is summed directly over t < i (no difference of cumulative sums, whose
  # rounding would otherwise leak into the gradient w.r.t. g where the weight is ~1).
  after = same_doc & (pos[:, None] < pos[None, :])  # [B, 1, N, C, C]
  to_end = jnp.matmul(after.astype(f32), g, precision=_HI)  # [B, H, N, C, K], <= 0
  in_last_doc = (doc == doc[..., -1:]).astype(f32)[..., None]  # [B, 1, N, C, 1]
  k_state = k * jnp.exp(to_end) * in_last_doc  # [B, H, N, C, K]
  state_decay = jnp.exp(G[..., -1, :]) * sees_state[..., -1:]  # [B, H, N, K]

  S = (jnp.zeros((B, H, K, V), f32) if initial_state is None
       else jnp.asarray(initial_state, f32))

  def step(S, xs):  # S: [B, H, K, V]
    q_s, k_s, w_c, u_c, A, dec = xs  # [B, H, C, K] x3, [B, H, C, V], [B, H, C, C], [B, H, K]
    v_new = u_c - jnp.matmul(w_c, S, precision=_HI)  # [B, H, C, V]
    o = jnp.matmul(q_s, S, precision=_HI) + jnp.matmul(A, v_new, precision=_HI)
    S = dec[..., None] * S + jnp.matmul(jnp.swapaxes(k_s, -1, -2), v_new, precision=_HI)
    return S, o

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q_state, k_state, w, u, A_qk, state_decay))
  S, o = jax.lax.scan(step, S, xs)  # o: [N, B, H, C, V]
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, V)[:, :T]
  o = o.astype(out_dtype)
  return (o, S) if output_final_state else o


def _document_index(segment_ids, B, T):
  """[B, T] int32 run index: +1 wherever the id changes (repeated ids in separate runs
  stay separate documents)."""
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                          jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def _masked_exp(x, mask):
  """exp(x) where mask, else exactly 0 (and no overflow or gradient from the masked x)."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _intra_chunk_scores(q, k, g, G, doc, causal, L):
  """Decayed scores of same-document pairs inside each chunk.

  A_qk[t, j] = sum_c q_tc k_jc exp(G_tc - G_jc) for j <= t, A_kk the same with k for q and
  j < t; 0 elsewhere. Each sub-chunk block is one matmul of a row and a column factor:
  diagonal blocks use a per-token reference (the first token of the block in the token's
  document), blocks below the diagonal use the last token of the column block.

  Args:
    q, k, g, G: [..., C, K] (leading dims B, H, N); G is g summed over `causal`.
    doc: [..., C] document index, broadcasting against the leading dims.
    causal: [..., C, C] same-document and j <= t.
    L: sub-chunk length.

  Returns:
    A_qk, A_kk: [..., C, C].
  """
  C = q.shape[-2]
  n = C // L
  blocks = lambda y: y.reshape(*y.shape[:-2], n, L, y.shape[-1])  # [..., C, K] -> [..., n, L, K]
  pos = jnp.arange(C)

  # Diagonal blocks: reference token r(t) = max(block start, document start) <= t. The
  # exponent G_t - G_r(t) is summed directly over r(t) < i <= t (a masked matmul, no
  # cancellation), so it lies in [LOWER_BOUND (L - 1), 0].
  starts = jnp.concatenate([jnp.ones_like(doc[..., :1], bool), doc[..., 1:] != doc[..., :-1]],
                           axis=-1)
  doc_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=doc.ndim - 1)
  ref_pos = jnp.maximum(doc_start, pos // L * L)  # [..., C]
  span = causal & (pos[None, :] > ref_pos[..., :, None])  # [..., C, C]
  e = jnp.matmul(span.astype(g.dtype), g, precision=_HI)  # [..., C, K]
  row_diag, k_diag = jnp.exp(e), blocks(k * jnp.exp(-e))  # [..., C, K], [..., n, L, K]
  eye_n = jnp.eye(n, dtype=q.dtype)

  # Blocks below the diagonal: for column block b, reference = G at its last token, which
  # lies between every pair (t, j) with t after block b and j in it, so both factors are
  # <= 1. Row factors are masked to 0 for t not after block b and for t outside that
  # reference token's document (cross-document pairs).
  G_end = blocks(G)[..., -1, :]  # [..., n, K]
  doc_end = doc[..., L - 1::L]  # [..., n]
  after_block = pos[None, :] // L > jnp.arange(n)[:, None]  # [n (b), C (t)]
  row_ok = after_block & (doc[..., None, :] == doc_end[..., :, None])  # [..., n, C]
  row_off = _masked_exp(G[..., None, :, :] - G_end[..., :, None, :],
                        row_ok[..., None])  # [..., n, C, K]
  col_ok = (doc.reshape(*doc.shape[:-1], n, L) == doc_end[..., None])[..., None]  # [..., n, L, 1]
  k_off = blocks(k) * _masked_exp(G_end[..., :, None, :] - blocks(G), col_ok)  # [..., n, L, K]

  def scores(x):  # [..., C, K] -> [..., C, C], rows x against columns k
    diag = jnp.einsum('...ntk,...nsk->...nts', blocks(x * row_diag), k_diag, precision=_HI)
    diag = jnp.einsum('...ats,ab->...atbs', diag, eye_n)  # onto the block diagonal
    off = jnp.einsum('...btk,...bsk->...tbs', x[..., None, :, :] * row_off, k_off,
                     precision=_HI)  # [..., C (t), n (b), L (s)]
    return (diag.reshape(off.shape) + off).reshape(*x.shape[:-2], C, C)

  # The diagonal t = j has decay 1 whatever g is: it is taken as q_t . k_t outside the
  # factorized product, so no rounding of that product reaches the gradient w.r.t. g.
  strict = causal & (pos[:, None] != pos[None, :])
  qk = jnp.sum(q * k, axis=-1)  # [..., C]
  A_qk = jnp.where(strict, scores(q), 0.0)
  A_qk = jnp.where(pos[:, None] == pos[None, :], qk[..., :, None], A_qk)
  A_kk = jnp.where(strict, scores(k), 0.0)
  return A_qk, A_kk


def _invert_unit_lower(A):
  """(I + A)^-1 for strictly lower-triangular A [..., C, C].

  Recursive block inversion in plain matmuls, doubling the block size each step:
  inv([[A11 + I, 0], [A21, A22 + I]]) = [[X11, 0], [-X22 A21 X11, X22]]. As accurate as a
  triangular solve here, in log2(C) steps. (jax.lax.linalg.triangular_solve was the first
  choice, but inside this function's gradient it hung XLA:CPU of jax 0.10.2 on a second
  call.)
  """
  n = A.shape[-1]
  C = 1 << (n - 1).bit_length()  # zero-pad to a power of two (identity rows/columns)
  A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, C - n), (0, C - n)])
  X = jnp.ones((*A.shape[:-2], C, 1, 1), A.dtype)  # inverses of the 1 x 1 diagonal blocks
  s = 1
  while s < C:
    m = C // (2 * s)
    A4 = A.reshape(*A.shape[:-2], m, 2 * s, m, 2 * s)
    A_diag = jnp.moveaxis(jnp.diagonal(A4, axis1=-4, axis2=-2), -1, -3)  # [..., m, 2s, 2s]
    A21 = A_diag[..., s:, :s]  # [..., m, s, s]
    X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]  # [..., m, s, s]
    X21 = -jnp.matmul(X22, jnp.matmul(A21, X11, precision=_HI), precision=_HI)
    X = jnp.concatenate([jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1),
                         jnp.concatenate([X21, X22], axis=-1)], axis=-2)  # [..., m, 2s, 2s]
    s *= 2
  return X[..., 0, :n, :n]

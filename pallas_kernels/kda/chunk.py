"""Chunkwise Kimi Delta Attention in plain JAX, fp32 (K3_SPEC 2.1, "Chunkwise form"):
`naive.kda_naive` as matmuls over chunks of C tokens, the [K, V] state S carried by a scan.
Per chunk, with G the cumulative log-decay [C, K] (the UT transform, then the state):
    A_kk = StrictTril(diag(beta) (K e^G)(K e^-G)^T);  [u, w] = (I + A_kk)^-1 [beta V, beta K e^G]
    o = (scale Q e^G) S + Tril((scale Q e^G)(K e^-G)^T) (u - w S)
    S <- e^{G_last} S + (K e^{G_last - G})^T (u - w S)
e^{G_t - G_j} is split into row and column factors per sub-chunk of L tokens, bounded by
e^{|LOWER_BOUND| (L - 1)} if LOWER_BOUND <= g <= 0; an unbounded gate (`bounded_gate=False`)
takes the diagonal L-blocks elementwise instead ([C, L, K] a chunk)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOWER_BOUND = -5.0  # K3's bounded gate: g in (LOWER_BOUND, 0)
_MAX_EXPONENT = 80.0
_HI = jax.lax.Precision.HIGHEST


def check_sub_chunk(sub_chunk_size: int):
  """ValueError unless |LOWER_BOUND| (L - 1) <= _MAX_EXPONENT (a tile's decays fit fp32)."""
  if -LOWER_BOUND * (sub_chunk_size - 1) > _MAX_EXPONENT:
    raise ValueError(f"sub_chunk_size={sub_chunk_size} is too long for the gate bound "
                     f"{LOWER_BOUND}: decays over one tile would overflow float32")


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
              output_final_state=False, chunk_size=64, sub_chunk_size=16, bounded_gate=True):
  """`kda_naive`'s contract, any T; chunk_size % sub_chunk_size == 0. bounded_gate:
  LOWER_BOUND <= g <= 0 (K3's gate); False: any g <= 0."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  if chunk_size % sub_chunk_size:
    raise ValueError(f"chunk_size={chunk_size} is not a multiple of "
                     f"sub_chunk_size={sub_chunk_size}")
  if bounded_gate:
    check_sub_chunk(sub_chunk_size)
  if scale is None:
    scale = K ** -0.5
  out_dtype = q.dtype
  C = chunk_size
  pad = -T % C
  N = (T + pad) // C
  f32 = jnp.float32

  def chunked(x):
    # zero padding leaves the state unchanged: g = 0 (no decay), beta = 0 (no write)
    x = jnp.asarray(x, f32)
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, N, C, *x.shape[2:]), 3, 1)

  q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
  doc = document_index(segment_ids, B, T)
  doc = jnp.pad(doc, [(0, 0), (0, pad)], mode="edge")
  doc = doc.reshape(B, 1, N, C)

  pos = jnp.arange(C)
  same_doc = doc[..., :, None] == doc[..., None, :]
  causal = same_doc & (pos[:, None] >= pos[None, :])
  # a masked sum, not a cumsum: not even rounding noise reaches an earlier document's grads
  G = jnp.matmul(causal.astype(f32), g, precision=_HI)

  A_qk, A_kk = _intra_chunk_scores(scale * q, k, g, G, doc, causal, sub_chunk_size,
                                   bounded_gate)
  A_kk = beta[..., None] * A_kk

  # the state entering a chunk belongs to the document of the token before it
  doc_state = jnp.concatenate([doc[..., :1, 0], doc[..., :-1, -1]], axis=-1)
  sees_state = (doc == doc_state[..., None]).astype(f32)
  decay = jnp.exp(G)
  rhs = jnp.concatenate([beta[..., None] * v,
                         (beta * sees_state)[..., None] * k * decay], axis=-1)
  uw = jnp.matmul(_invert_unit_lower(A_kk), rhs, precision=_HI)
  u, w = uw[..., :V], uw[..., V:]
  q_state = (scale * sees_state)[..., None] * q * decay

  # G_last - G_t summed directly: a difference of cumsums leaks rounding into dg near 1
  after = same_doc & (pos[:, None] < pos[None, :])
  to_end = jnp.matmul(after.astype(f32), g, precision=_HI)
  in_last_doc = (doc == doc[..., -1:]).astype(f32)[..., None]
  k_state = k * jnp.exp(to_end) * in_last_doc
  state_decay = jnp.exp(G[..., -1, :]) * sees_state[..., -1:]

  S = (jnp.zeros((B, H, K, V), f32) if initial_state is None
       else jnp.asarray(initial_state, f32))

  def step(S, xs):
    q_s, k_s, w_c, u_c, A, dec = xs
    v_new = u_c - jnp.matmul(w_c, S, precision=_HI)
    o = jnp.matmul(q_s, S, precision=_HI) + jnp.matmul(A, v_new, precision=_HI)
    S = dec[..., None] * S + jnp.matmul(jnp.swapaxes(k_s, -1, -2), v_new, precision=_HI)
    return S, o

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q_state, k_state, w, u, A_qk, state_decay))
  S, o = jax.lax.scan(step, S, xs)
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, V)[:, :T]
  o = o.astype(out_dtype)
  return (o, S) if output_final_state else o


def document_index(segment_ids, B, T):
  """[B, T] int32: each token's document, numbered from 0 along the row (0s without ids)."""
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                          jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def _masked_exp(x, mask):
  """exp(x) where mask, else exactly 0 (and no overflow or gradient from the masked x)."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _intra_chunk_scores(q, k, g, G, doc, causal, L, bounded_gate):
  """A_qk [..., C, C] = sum_c q_tc k_jc e^{G_tc - G_jc} over same-document j <= t; A_kk
  the same with k for q, j < t. Each L-block below the diagonal is one matmul of row and
  column factors; so are the diagonal ones for a bounded gate, else elementwise."""
  C = q.shape[-2]
  n = C // L
  blocks = lambda y: y.reshape(*y.shape[:-2], n, L, y.shape[-1])
  pos = jnp.arange(C)

  # diagonal blocks: factors referenced to r(t) = max(block start, document start)
  starts = jnp.concatenate([jnp.ones_like(doc[..., :1], bool), doc[..., 1:] != doc[..., :-1]],
                           axis=-1)
  doc_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=doc.ndim - 1)
  ref_pos = jnp.maximum(doc_start, pos // L * L)
  span = causal & (pos[None, :] > ref_pos[..., :, None])
  e = jnp.matmul(span.astype(g.dtype), g, precision=_HI)
  row_diag, k_diag = (jnp.exp(e), blocks(k * jnp.exp(-e))) if bounded_gate else (None, None)
  eye_n = jnp.eye(n, dtype=q.dtype)

  # below the diagonal: referenced to column block b's last token, so both factors are <= 1
  G_end = blocks(G)[..., -1, :]
  doc_end = doc[..., L - 1::L]
  after_block = pos[None, :] // L > jnp.arange(n)[:, None]
  row_ok = after_block & (doc[..., None, :] == doc_end[..., :, None])
  row_off = _masked_exp(G[..., None, :, :] - G_end[..., :, None, :],
                        row_ok[..., None])
  doc_blocks = doc.reshape(*doc.shape[:-1], n, L)
  col_ok = (doc_blocks == doc_end[..., None])[..., None]
  k_off = blocks(k) * _masked_exp(G_end[..., :, None, :] - blocks(G), col_ok)

  if not bounded_gate:  # e_t - e_s over a diagonal block's same-document pairs s <= t: <= 0
    pair_ok = ((doc_blocks[..., :, None] == doc_blocks[..., None, :])
               & (jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]))[..., None]
    pair_decay = _masked_exp(blocks(e)[..., :, None, :] - blocks(e)[..., None, :, :],
                             pair_ok)                                   # [..., n, L, L, K]

  def scores(x):
    if bounded_gate:
      diag = jnp.einsum('...ntk,...nsk->...nts', blocks(x * row_diag), k_diag, precision=_HI)
    else:
      diag = jnp.einsum('...ntk,...nsk,...ntsk->...nts', blocks(x), blocks(k), pair_decay,
                        precision=_HI)
    diag = jnp.einsum('...ats,ab->...atbs', diag, eye_n)
    off = jnp.einsum('...btk,...bsk->...tbs', x[..., None, :, :] * row_off, k_off,
                     precision=_HI)
    return (diag.reshape(off.shape) + off).reshape(*x.shape[:-2], C, C)

  # t = j decays by exactly 1: q_t . k_t, so no factor rounding reaches dg
  strict = causal & (pos[:, None] != pos[None, :])
  qk = jnp.sum(q * k, axis=-1)
  A_qk = jnp.where(strict, scores(q), 0.0)
  A_qk = jnp.where(pos[:, None] == pos[None, :], qk[..., :, None], A_qk)
  A_kk = jnp.where(strict, scores(k), 0.0)
  return A_qk, A_kk


def _invert_unit_lower(A):
  """(I + A)^-1, A [..., C, C] strictly lower, by block doubling in log2(C) matmul steps:
  inv([[A11 + I, 0], [A21, A22 + I]]) = [[X11, 0], [-X22 A21 X11, X22]]. (Not
  triangular_solve: its gradient hangs XLA:CPU, jax 0.10.2.)"""
  n = A.shape[-1]
  C = 1 << (n - 1).bit_length()
  A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, C - n), (0, C - n)])
  X = jnp.ones((*A.shape[:-2], C, 1, 1), A.dtype)
  s = 1
  while s < C:
    m = C // (2 * s)
    A4 = A.reshape(*A.shape[:-2], m, 2 * s, m, 2 * s)
    A_diag = jnp.moveaxis(jnp.diagonal(A4, axis1=-4, axis2=-2), -1, -3)
    A21 = A_diag[..., s:, :s]
    X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]
    X21 = -jnp.matmul(X22, jnp.matmul(A21, X11, precision=_HI), precision=_HI)
    X = jnp.concatenate([jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1),
                         jnp.concatenate([X21, X22], axis=-1)], axis=-2)
    s *= 2
  return X[..., 0, :n, :n]

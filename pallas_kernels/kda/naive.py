"""Reference Kimi Delta Attention: the literal fp32 recurrence every backend is tested against
(K3_SPEC 2.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def kda_naive(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
              output_final_state=False):
  """Gated delta rule, per-channel decay; per (b, h) a state S [K, V] fp32, per token:
      S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)
  q, k [B, T, H, K] (any L2 norm is the caller's); v [B, T, H, V]; g [B, T, H, K] <= 0;
  beta [B, T, H]; scale default K ** -0.5; initial_state [B, H, K, V] (first document only);
  segment_ids [B, T]: the state resets where the id changes. Returns o [B, T, H, V] in q's
  dtype, and the final state [B, H, K, V] fp32 if output_final_state."""
  B, T, H, K = q.shape
  if scale is None:
    scale = K ** -0.5
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  state = (jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None
           else f32(initial_state))
  if segment_ids is None:
    reset = jnp.zeros((B, T), bool)
  else:
    reset = jnp.concatenate(
        [jnp.zeros((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)

  def step(S, xs):
    q_t, k_t, v_t, g_t, b_t, reset_t = xs
    S = jnp.where(reset_t[:, None, None, None], 0.0, S)
    S = S * jnp.exp(g_t)[..., None]
    v_err = v_t - jnp.einsum('bhkv,bhk->bhv', S, k_t, precision=_HI)
    S = S + jnp.einsum('bhk,bhv->bhkv', b_t[..., None] * k_t, v_err, precision=_HI)
    o_t = jnp.einsum('bhkv,bhk->bhv', S, scale * q_t, precision=_HI)
    return S, o_t

  time_major = lambda x: jnp.moveaxis(f32(x), 1, 0)
  xs = (time_major(q), time_major(k), time_major(v), time_major(g), time_major(beta),
        jnp.moveaxis(reset, 1, 0))
  state, o = jax.lax.scan(step, state, xs)
  o = jnp.moveaxis(o, 0, 1).astype(q.dtype)
  return (o, state) if output_final_state else o

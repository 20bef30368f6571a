"""Dense masked softmax attention, fp32 [B, H, Tq, T] scores: every backend's reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(segment_ids: jax.Array, causal: bool = True, q_offset=0,
                   q_len: int | None = None) -> jax.Array:
  """[B, Tq, T] for q_len queries from q_offset (int or traced): a token sees its segment
  (causal: up to itself); padding (0) sees only itself, so no softmax is empty."""
  t = segment_ids.shape[-1]
  q_len = t if q_len is None else q_len
  q_pos = q_offset + jnp.arange(q_len)
  kv_pos = jnp.arange(t)
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, q_len, axis=1)
  same = q_ids[:, :, None] == segment_ids[:, None, :]
  real = (q_ids != 0)[:, :, None]
  diag = kv_pos[None, :] == q_pos[:, None]
  mask = same & (real | diag[None])
  if causal:
    mask &= (kv_pos[None, :] <= q_pos[:, None])[None]
  return mask


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                        *, scale: float, causal: bool,
                        q_offset=0) -> tuple[jax.Array, jax.Array]:
  """q [B, Tq, H, Dqk] at q_offset, k [B, T, H or 1, Dqk], v [B, T, H, Dv] -> (out
  [B, Tq, H, Dv] in v's dtype, each head's max logit over real queries [H] fp32, no grad)."""
  tq = q.shape[1]
  scores = jnp.einsum("bthd,bshd->bhts", q, k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  mask = attention_mask(segment_ids, causal, q_offset, tq)[:, None]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  p = jnp.exp(scores - row_max)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, tq, axis=1)
  real = (q_ids != 0)[:, None, :]
  logit_max = jnp.max(jnp.where(real, row_max[..., 0], -jnp.inf), axis=(0, 2))
  return out.astype(v.dtype), logit_max

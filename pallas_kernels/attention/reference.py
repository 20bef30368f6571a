"""Dense masked softmax attention: the reference every backend is tested against.

Scores [B, H, Tq, T] are materialized in float32, so this is for short sequences, CPU, and
per device under context parallelism (Tq = T / c query rows against all T keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(segment_ids: jax.Array, causal: bool = True, q_offset=0,
                   q_len: int | None = None) -> jax.Array:
  """Document mask [B, Tq, T] (query t, key s) from segment ids [B, T], causal or not.

  The queries are the q_len (default T) tokens from position q_offset (an int or a traced
  scalar) of the sequence; the keys are all T tokens. A token sees the keys of its own
  segment (causal: those at s <= its position). Segment 0 is padding: a padding token sees
  only itself, so every row has at least one key and no softmax is empty.
  """
  t = segment_ids.shape[-1]
  q_len = t if q_len is None else q_len
  q_pos = q_offset + jnp.arange(q_len)                                   # [Tq]
  kv_pos = jnp.arange(t)
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, q_len, axis=1)
  same = q_ids[:, :, None] == segment_ids[:, None, :]                    # [B, Tq, T]
  real = (q_ids != 0)[:, :, None]                                        # [B, Tq, 1]
  diag = kv_pos[None, :] == q_pos[:, None]
  mask = same & (real | diag[None])
  if causal:
    mask &= (kv_pos[None, :] <= q_pos[:, None])[None]
  return mask


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                        *, scale: float, causal: bool,
                        q_offset=0) -> tuple[jax.Array, jax.Array]:
  """Plain masked softmax attention (`attention_mask`).

  q: [B, Tq, H, Dqk], the queries at positions q_offset .. q_offset + Tq - 1 (q_offset an
  int or a traced scalar; default: all T); k: [B, T, H or 1, Dqk] (1 = one key shared by
  all heads); v: [B, T, H, Dv]; segment_ids: [B, T] int (0 = padding). Scores [B, H, Tq, T]
  and softmax in fp32. Returns the output [B, Tq, H, Dv] in v's dtype and, for QK-Clip,
  each head's largest pre-softmax logit over the real (non-padding) queries and the keys
  they see: [H] fp32, without gradient (-inf for a head with no real query). It reuses the
  softmax's row maxima, so it costs one small reduction.
  """
  tq = q.shape[1]
  scores = jnp.einsum("bthd,bshd->bhts", q, k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale       # [B, H, Tq, T]
  mask = attention_mask(segment_ids, causal, q_offset, tq)[:, None]     # [B, 1, Tq, T]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # [B, H, Tq, 1]
  p = jnp.exp(scores - row_max)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  q_ids = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, tq, axis=1)
  real = (q_ids != 0)[:, None, :]                                        # [B, 1, Tq]
  logit_max = jnp.max(jnp.where(real, row_max[..., 0], -jnp.inf), axis=(0, 2))
  return out.astype(v.dtype), logit_max

"""Dense masked softmax attention: the reference every backend is tested against.

Scores [B, H, T, T] are materialized in float32, so this is for short sequences and CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(segment_ids: jax.Array, causal: bool = True) -> jax.Array:
  """Document mask [B, T, T] (query t, key s) from segment ids [B, T], causal or not.

  A token sees the keys of its own segment (causal: those at s <= t). Segment 0 is
  padding: a padding token sees only itself, so every row has at least one key and no
  softmax is empty.
  """
  t = segment_ids.shape[-1]
  pos = jnp.arange(t)
  same = segment_ids[:, :, None] == segment_ids[:, None, :]              # [B, T, T]
  real = (segment_ids != 0)[:, :, None]                                  # [B, T, 1]
  diag = pos[None, :] == pos[:, None]
  mask = same & (real | diag[None])
  if causal:
    mask &= (pos[None, :] <= pos[:, None])[None]
  return mask


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                        *, scale: float, causal: bool) -> tuple[jax.Array, jax.Array]:
  """Plain masked softmax attention (`attention_mask`).

  q: [B, T, H, Dqk]; k: [B, T, H or 1, Dqk] (1 = one key shared by all heads);
  v: [B, T, H, Dv]; segment_ids: [B, T] int (0 = padding). Scores and softmax in fp32.
  Returns the output [B, T, H, Dv] in v's dtype and, for QK-Clip, each head's largest
  pre-softmax logit over the real (non-padding) queries and the keys they see: [H] fp32,
  without gradient (-inf for a head with no real query). It reuses the softmax's row
  maxima, so it costs one small reduction.
  """
  scores = jnp.einsum("bthd,bshd->bhts", q, k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale       # [B, H, T, T]
  mask = attention_mask(segment_ids, causal)[:, None]                    # [B, 1, T, T]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # [B, H, T, 1]
  p = jnp.exp(scores - row_max)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  real = (segment_ids != 0)[:, None, :]                                  # [B, 1, T]
  logit_max = jnp.max(jnp.where(real, row_max[..., 0], -jnp.inf), axis=(0, 2))
  return out.astype(v.dtype), logit_max

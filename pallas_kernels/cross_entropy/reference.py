"""Each position's cross-entropy against its target, plain JAX, in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_reference(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [..., V] (any float dtype), targets [...] int -> fp32 [...]: logsumexp(logits) -
  logits[target] (a target outside [0, V) picks 0). XLA reads the logits twice: the max, then
  the sum (with the pick)."""
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  # The target's logit by a select, not a gather: its gradient is a select too, where a
  # gather's is a scatter-add that deterministic XLA rewrites element by element over [B, T, V]
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
  return logz - picked

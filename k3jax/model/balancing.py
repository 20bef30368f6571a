"""The MoE balancers beside Quantile Balancing, for the ablation of K3_SPEC 7.

`model.moe.balancing`: "quantile" (quantile_balancing.py), "aux_free" (`sign_step` on the
`BalanceBias`), "aux_loss" (`switch_loss` times `moe.aux_loss_weight`) or "none"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BALANCINGS = ("quantile", "aux_free", "aux_loss", "none")  # model.moe.balancing


def sign_step(bias: jax.Array, load: jax.Array, speed: float) -> jax.Array:
  """DeepSeek-V3's update b_j + speed * sign(mean load - load_j); bias, load [..., E]."""
  load = load.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return bias.astype(jnp.float32) + speed * jnp.sign(mean - load)


def switch_loss(scores: jax.Array, idx: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """The Switch / GShard load-balancing loss of one routing, unweighted: E sum_j f_j P_j.
  scores: [N, E]; idx: [N, k]; valid: [N] bool or None. f_j: share of pairs routed to j
  (no gradient); P_j: mean of the per-token normalised sigmoid scores (as DeepSeek-V3).
  1 on a balanced routing; fp32 [], 0 without valid tokens."""
  scores = scores.astype(jnp.float32)
  num_experts = scores.shape[-1]
  mask = jnp.ones(scores.shape[:-1], jnp.float32) if valid is None else valid.astype(
      jnp.float32)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # [N, E]
  p_mean = jnp.sum(probs * mask[:, None], axis=0) / tokens  # [E]
  pairs = jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(
      jnp.broadcast_to(mask[:, None], idx.shape).reshape(-1))
  f = pairs / (idx.shape[-1] * tokens)  # [E]
  return num_experts * jnp.sum(f * p_mean)

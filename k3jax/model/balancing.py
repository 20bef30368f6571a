"""The MoE balancers beside Quantile Balancing, for the ablation of K3_SPEC 7.

`model.moe.balancing` names one of `BALANCINGS`:
  "quantile": K3's Quantile Balancing (`quantile_balancing.py`): the selection bias solved
      each step from a histogram of the routing's margins;
  "aux_free": DeepSeek-V3's auxiliary-loss-free balancing: the same selection bias, moved
      each step by `sign_step` against the step's expert loads;
  "aux_loss": no bias; a Switch / GShard auxiliary loss (`switch_loss`), weighted by
      `moe.aux_loss_weight`, is added to the LM loss;
  "none": neither.

Both biases are the `BalanceBias` of each MoE layer: selection only (top-k of s + b, the
mixing weights from s alone), updated outside the gradient after the optimizer step
(`LatentMoE.update_balance`), saved with the checkpoint. QB solves for b, aux-free steps it.

Shapes: N tokens, E experts, k selected per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BALANCINGS = ("quantile", "aux_free", "aux_loss", "none")  # model.moe.balancing


def sign_step(bias: jax.Array, load: jax.Array, speed: float) -> jax.Array:
  """DeepSeek-V3's bias update: b_j + speed * sign(mean load - load_j).

  bias: [..., E] fp32 (a stacked [layers, E] for scanned layers); load: [..., E], the
  step's valid (token, slot) pairs per expert, summed over microbatches and devices (the
  mean is over E). An overloaded expert's bias falls by `speed`, an underloaded one's rises
  by it, one at the mean load (or a step without tokens) keeps its bias. Not mean-centred.
  """
  load = load.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return bias.astype(jnp.float32) + speed * jnp.sign(mean - load)


def switch_loss(scores: jax.Array, idx: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """The Switch / GShard load-balancing loss of one routing, unweighted: E sum_j f_j P_j.

  scores: [N, E] router scores; idx: [N, k] the selected experts; valid: [N] bool or None
  (all valid). Over the valid tokens:
    f_j = (pairs (token, slot) routed to expert j) / (k * tokens): sum_j f_j = 1; a count
          of a top-k selection, so no gradient flows through it;
    P_j = the mean of p_ij = s_ij / sum_j' s_ij': sum_j P_j = 1; the router's gradient.
  K3's scores are sigmoids (K3_SPEC 4), each in (0, 1) on its own, not a distribution over
  the experts: P normalises them per token over all E experts, as DeepSeek-V3's sequence-wise
  balance loss does (Switch's softmax probabilities are already normalised).

  1 when f or P is uniform (1/E each), so that alpha times it equals alpha on a perfectly
  balanced routing; larger as the experts with the most pairs also get the most score.
  Returns fp32 []: 0 without valid tokens.
  """
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

"""Quantile Balancing (K3_SPEC 4.2): the expert-selection bias, solved from a histogram.

Per step: `route` (top-(k+1) of s + b; alpha_i the (k+1)-th), `histogram` (r_ij = alpha_i -
s_ij per expert, summed over microbatches and devices), `solve_bias` (b_j = the (k/n)-quantile
of r_{:, j}). The `BalanceBias` only selects. N tokens, E experts, k per token, B bins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class BalanceBias(nnx.Variable):
  """Per-expert selection bias b [E] (fp32); not an `nnx.Param`, so never trained."""


def route(scores: jax.Array, bias: jax.Array, k: int):
  """Top-k selection on scores + bias; weights from the scores alone.
  scores: [..., E] fp32; bias: [E]. Returns idx [..., k] int32, weights [..., k] fp32
  (normalised selected scores), alpha [...] the (k+1)-th largest s + b (-inf if k == E)."""
  scores = scores.astype(jnp.float32)
  num_experts = scores.shape[-1]
  if not 1 <= k <= num_experts:
    raise ValueError(f"route: k={k} must be in [1, {num_experts}]")
  biased = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))
  vals, ids = jax.lax.top_k(biased, min(k + 1, num_experts))
  idx = ids[..., :k].astype(jnp.int32)
  if k < num_experts:
    alpha = vals[..., k]
  else:
    alpha = jnp.full(scores.shape[:-1], -jnp.inf, jnp.float32)
  # [..., k] by a select: its gradient is a select too, not a scatter-add (a gather's)
  hit = idx[..., None] == jnp.arange(num_experts, dtype=idx.dtype)       # [..., k, E]
  chosen = jnp.sum(jnp.where(hit, scores[..., None, :], 0.0), axis=-1)
  weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
  return idx, weights, alpha


def bin_range(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(lo, hi) = (min b - 1, max b + 1): every r = alpha - s lies inside for s in (0, 1)."""
  bias = bias.astype(jnp.float32)
  return jnp.min(bias) - 1.0, jnp.max(bias) + 1.0


CUTOFFS = ("k_plus_1", "leave_one_out")


def histogram(scores: jax.Array, alpha: jax.Array, bias: jax.Array, num_bins: int,
              valid: jax.Array | None = None, cutoff: str = "k_plus_1") -> jax.Array:
  """Counts of r_ij = alpha_i - s_ij per expert over `num_bins` bins of `bin_range(bias)`.
  scores: [N, E]; alpha: [N]; bias: [E] (fixes the bin edges); valid: [N] bool or None.
  Returns int32 [E, num_bins], out-of-range values in the end bins. cutoff "k_plus_1" is
  K3_SPEC 4.2; "leave_one_out" uses the k-th value for unselected experts, removing the
  atom at r_ij = b_j (see `solve_bias`)."""
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  alpha = jax.lax.stop_gradient(alpha.astype(jnp.float32))
  num_experts = scores.shape[-1]
  lo, hi = bin_range(jax.lax.stop_gradient(bias))
  width = (hi - lo) / num_bins
  r = alpha[:, None] - scores  # [N, E]
  if cutoff == "leave_one_out":
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    chosen = biased > alpha[:, None]  # [N, E] the token's k selected experts
    kth = jnp.min(jnp.where(chosen, biased, jnp.inf), axis=-1)  # [N] k-th largest s + b
    r = jnp.where(chosen, alpha[:, None], kth[:, None]) - scores
  elif cutoff != "k_plus_1":
    raise ValueError(f"histogram: unknown cutoff {cutoff!r}; known: {CUTOFFS}")
  bins = jnp.clip(jnp.floor((r - lo) / width), 0, num_bins - 1).astype(jnp.int32)
  flat = bins + jnp.arange(num_experts, dtype=jnp.int32) * num_bins  # [N, E]
  if valid is None:
    weight = jnp.ones(flat.shape, jnp.int32)
  else:
    weight = jnp.broadcast_to(valid.astype(jnp.int32)[:, None], flat.shape)
  counts = jnp.zeros((num_experts * num_bins,), jnp.int32).at[flat.reshape(-1)].add(
      weight.reshape(-1))
  return counts.reshape(num_experts, num_bins)


def solve_bias(counts: jax.Array, bias: jax.Array, k: int, center: bool = True) -> jax.Array:
  """The new bias [E] from a step's summed histogram `counts` [E, B] (int32).
  `bias`: the bias the histogram was taken with; k: a Python int. Expert j's load is
  #{i : r_ij < b_j}, so b_j is interpolated where the cumulative count reaches
  ceil(m k / n); mean-centred unless `center=False`; the old bias if nothing was counted.
  With "k_plus_1" each expert's own b_j is an atom of its histogram, so loads within it of
  the target stall (benchmarks/results/moe.md); "leave_one_out" removes it."""
  counts = counts.astype(jnp.int32)
  num_experts, num_bins = counts.shape
  lo, hi = bin_range(bias)
  width = (hi - lo) / num_bins
  m = jnp.sum(counts, axis=-1)  # [E] tokens counted (each token counts once per expert)
  # ceil(m k / n) without forming m * k, which overflows int32 for large m.
  target = (m // num_experts) * k + (((m % num_experts) * k + num_experts - 1) // num_experts)
  cum = jnp.cumsum(counts, axis=-1)  # [E, B]
  q = jnp.argmax(cum >= target[:, None], axis=-1)  # [E] first bin reaching the target
  in_bin = jnp.take_along_axis(counts, q[:, None], axis=-1)[:, 0]
  before = jnp.take_along_axis(cum, q[:, None], axis=-1)[:, 0] - in_bin
  frac = (target - before).astype(jnp.float32) / jnp.maximum(in_bin, 1).astype(jnp.float32)
  new = lo + (q.astype(jnp.float32) + frac) * width
  if center:
    new = new - jnp.mean(new)
  return jnp.where(jnp.all(m > 0), new, bias.astype(jnp.float32))


def load_stats(idx: jax.Array, num_experts: int, valid: jax.Array | None = None) -> dict:
  """{'load' [E], 'max_over_mean', 'min_over_mean'} of idx [..., k] over valid tokens."""
  if valid is None:
    weight = jnp.ones(idx.shape, jnp.int32)
  else:
    weight = jnp.broadcast_to(valid.astype(jnp.int32)[..., None], idx.shape)
  load = jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(weight.reshape(-1))
  mean = jnp.maximum(jnp.sum(load).astype(jnp.float32) / num_experts, 1e-9)
  return {"load": load,
          "max_over_mean": jnp.max(load).astype(jnp.float32) / mean,
          "min_over_mean": jnp.min(load).astype(jnp.float32) / mean}

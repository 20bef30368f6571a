"""Quantile Balancing (K3_SPEC 4.2): the expert-selection bias, solved from a histogram.

The balanced assignment LP (each of m tokens picks k of n experts, each expert gets
m k / n tokens) has a dual with one variable per token (alpha_i) and one per expert
(b_j). Token i picks expert j exactly when s_ij + b_j beats alpha_i, the (k+1)-th largest
value of s_i + b. Holding alpha fixed, expert j receives the tokens with
r_ij = alpha_i - s_ij < b_j, so the b_j that gives it m k / n tokens is the (k/n)-quantile
of r_{:, j}. One step of this coordinate update per training step:

  1. `route`: top-(k+1) of s + b; the first k are dispatched, the (k+1)-th is alpha_i;
  2. `histogram`: counts of r_ij per expert over fixed bins spanning [min b - 1, max b + 1]
     (int32, summed over microbatches, then all-reduced over the data-parallel axes);
  3. `solve_bias`: per expert, the interpolated point where the cumulative count reaches
     ceil(m k / n), mean-centred; it becomes b for the next step.

The bias only selects; the mixing weights use the raw scores. It is `BalanceBias`, a
non-trainable variable updated outside the gradient, and frozen at inference.

Shapes: N tokens, E experts, k selected per token, B bins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class BalanceBias(nnx.Variable):
  """Per-expert selection bias b [E] (fp32) of Quantile Balancing; never trained.

  Optimizers filter on `nnx.Param`, so this variable gets no gradient update; the train
  step replaces it with `solve_bias` of the step's summed histogram.
  """


def route(scores: jax.Array, bias: jax.Array, k: int):
  """Top-k selection on scores + bias; weights from the scores alone.

  scores: [..., E] sigmoid router scores (fp32); bias: [E]; k: experts per token.
  Returns idx [..., k] int32 (by decreasing s + b), weights [..., k] fp32
  (s_j / sum_{j in T} s_j, differentiable in `scores`), and alpha [...] fp32, the
  (k+1)-th largest value of s + b (-inf when k equals E: no cutoff exists).
  """
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
  chosen = jnp.take_along_axis(scores, idx, axis=-1)  # [..., k]
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

  scores: [N, E]; alpha: [N]; bias: [E], the bias `alpha` was computed with (it fixes the
  edges, so every microbatch of a step shares them); valid: [N] bool or None (all valid).
  Returns int32 [E, num_bins]; values outside the range land in the end bins. Each valid
  token adds 1 to every expert, so the total is (valid tokens) * E.

  cutoff="k_plus_1" is K3_SPEC 4.2 (alpha_i for every expert). "leave_one_out" [D] uses
  for each expert the cutoff it actually faces with the other biases held fixed: alpha_i
  (the (k+1)-th value) for the experts token i selected, the k-th value for the others.
  That removes the atom at r_ij = b_j described in `solve_bias`, whose fixed points then
  balance (see tests/test_quantile_balancing.py for both).
  """
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

  `bias` [E] is the bias the histogram was taken with (it gives the bin edges); k is the
  number of experts per token (a Python int). Works under jit and vmap (e.g. over the
  stacked biases [layers, E] with `jax.vmap(solve_bias, (0, 0, None))`).

  Why a lower quantile of r gives b: with alpha_i the (k+1)-th largest s_i + b, token i
  takes expert j iff s_ij + b_j > alpha_i, i.e. iff r_ij = alpha_i - s_ij < b_j. So the
  load of expert j is #{i : r_ij < b_j}, a nondecreasing function of b_j, and the b_j
  that gives the balanced load m k / n is the (k/n)-quantile of the column r_{:, j}.
  (alpha itself moves with b; repeating the update each step is block coordinate descent
  on the dual, alternating alpha and b.) Per expert, the bin where the
  cumulative count first reaches ceil(m k / n) is found, b_j is interpolated linearly
  inside that bin, and b is mean-centred (a common shift of b changes no selection;
  `center=False` returns the raw quantiles, for tests). With no counted tokens the old
  bias is returned.

  Fixed points of this rule are not all balanced: every token whose (k+1)-th choice is
  expert j has r_ij = b_j exactly, so expert j's histogram has an atom at its own b_j
  (m / n tokens on average, far more for an expert whose scores are nearly constant),
  and an expert whose load lies in [target - atom, target] does not move. On a fixed
  skewed batch loads settle with min/mean ~0.87 (16 experts, top-4) to ~0.78 (128, top-16)
  while max/mean stays ~1.06. `histogram(..., cutoff="leave_one_out")` removes the atom.
  """
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
  """Per-expert load of a routing. idx: [..., k] int32; valid: [...] bool or None.

  Returns {'load': int32 [E] valid (token, slot) pairs per expert,
           'max_over_mean': fp32 max load / mean load (1 is perfect balance),
           'min_over_mean': fp32 min load / mean load}.
  Dispatch is dropless, so no tokens are dropped.
  """
  if valid is None:
    weight = jnp.ones(idx.shape, jnp.int32)
  else:
    weight = jnp.broadcast_to(valid.astype(jnp.int32)[..., None], idx.shape)
  load = jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(weight.reshape(-1))
  mean = jnp.maximum(jnp.sum(load).astype(jnp.float32) / num_experts, 1e-9)
  return {"load": load,
          "max_over_mean": jnp.max(load).astype(jnp.float32) / mean,
          "min_over_mean": jnp.min(load).astype(jnp.float32) / mean}

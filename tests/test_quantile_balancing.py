"""Quantile Balancing (K3_SPEC 4.2): routing, histograms, the bias solve, and convergence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import quantile_balancing as qb

# jitted once per shape: eager op-by-op dispatch is slow on CPU
route = jax.jit(qb.route, static_argnums=2)
histogram = jax.jit(qb.histogram, static_argnums=3, static_argnames=("cutoff",))
solve_bias = jax.jit(qb.solve_bias, static_argnums=2, static_argnames=("center",))


@jax.jit(static_argnums=(0, 1))
def skewed_scores(num_tokens, num_experts, seed=0, offset_std=2.0):
  """Sigmoid router scores with strong per-expert offsets: a badly unbalanced router."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  offsets = jax.random.normal(k1, (num_experts,)) * offset_std
  return jax.nn.sigmoid(jax.random.normal(k2, (num_tokens, num_experts)) + offsets)


def test_route_selection_weights_and_cutoff():
  scores = skewed_scores(64, 12, seed=1)
  bias = np.random.default_rng(2).normal(size=12).astype(np.float32) * 0.3
  k = 3
  idx, weights, alpha = route(scores, bias, k)
  assert idx.dtype == jnp.int32 and idx.shape == (64, k) and alpha.shape == (64,)
  biased = np.asarray(scores) + bias
  order = np.argsort(-biased, axis=-1)
  np.testing.assert_array_equal(np.asarray(idx), order[:, :k])
  np.testing.assert_allclose(np.asarray(alpha), np.take_along_axis(biased, order[:, k:k + 1],
                                                                    -1)[:, 0], rtol=1e-6)
  chosen = np.take_along_axis(np.asarray(scores), order[:, :k], -1)
  np.testing.assert_allclose(np.asarray(weights), chosen / chosen.sum(-1, keepdims=True),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def test_bias_selects_but_does_not_weight():
  scores = skewed_scores(32, 8, seed=3)
  k = 2
  zero, big5 = np.zeros(8, np.float32), np.zeros(8, np.float32)
  big5[5] = 10.0
  idx0, w0, a0 = route(scores, zero, k)
  # a common shift changes nothing but the cutoff
  idx1, w1, a1 = route(scores, zero + 0.7, k)
  np.testing.assert_array_equal(np.asarray(idx0), np.asarray(idx1))
  np.testing.assert_allclose(np.asarray(w0), np.asarray(w1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(a1) - np.asarray(a0), 0.7, rtol=1e-5)
  # a large bias on expert 5 forces it into every token's selection ...
  idx2, w2, _ = route(scores, big5, k)
  assert np.all(np.asarray(idx2)[:, 0] == 5)
  assert not np.array_equal(np.asarray(idx0), np.asarray(idx2))
  # ... and the weights of that selection are the raw scores' shares, bias-free
  chosen = np.take_along_axis(np.asarray(scores), np.asarray(idx2), -1)
  np.testing.assert_allclose(np.asarray(w2), chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
  # the weights get gradient from the scores, none from the bias
  def f(s, b):
    return jnp.sum(route(s, b, k)[1] * jnp.arange(k, dtype=jnp.float32))
  gs, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(scores, big5)
  assert np.max(np.abs(np.asarray(gs))) > 0 and np.max(np.abs(np.asarray(gb))) == 0


def test_histogram_totals_and_valid_mask():
  n, e, bins, k = 200, 10, 64, 3
  rng = np.random.default_rng(5)
  scores = np.asarray(skewed_scores(n, e, seed=4))
  bias = rng.normal(size=e).astype(np.float32) * 0.2
  alpha = np.asarray(route(scores, bias, k)[2])
  valid = rng.random(n) < 0.7
  counts = histogram(scores, alpha, bias, bins, valid)
  assert counts.shape == (e, bins) and counts.dtype == jnp.int32
  counts = np.asarray(counts)
  assert counts.sum() == valid.sum() * e
  np.testing.assert_array_equal(counts.sum(-1), valid.sum())
  np.testing.assert_array_equal(counts, np.asarray(
      histogram(scores[valid], alpha[valid], bias, bins)))
  # microbatch histograms sum to the full-batch one (same edges: the bias is fixed)
  halves = [np.asarray(histogram(scores[s], alpha[s], bias, bins, valid[s]))
            for s in (slice(0, 100), slice(100, n))]
  np.testing.assert_array_equal(halves[0] + halves[1], counts)
  # every r = alpha - s lands strictly inside the range: no clamping needed
  r = alpha[:, None] - scores
  assert r.min() > bias.min() - 1 and r.max() < bias.max() + 1


@pytest.mark.parametrize("cutoff", qb.CUTOFFS)
def test_solve_bias_matches_exact_quantile(cutoff):
  n, e, k, bins = 3000, 12, 3, 20_000
  scores = np.asarray(skewed_scores(n, e, seed=7))
  bias = np.random.default_rng(8).normal(size=e).astype(np.float32) * 0.3
  alpha = np.asarray(route(scores, bias, k)[2])
  counts = histogram(scores, alpha, bias, bins, cutoff=cutoff)
  width = (bias.max() - bias.min() + 2.0) / bins
  # exact: the ceil(m k / n)-th smallest r per expert, by sorting
  r = alpha[:, None] - scores
  if cutoff == "leave_one_out":
    biased = scores + bias
    chosen = biased > alpha[:, None]
    kth = np.where(chosen, biased, np.inf).min(-1)
    r = np.where(chosen, alpha[:, None], kth[:, None]) - scores
  target = -(-n * k // e)
  exact = np.sort(r, axis=0)[target - 1]
  raw = np.asarray(solve_bias(counts, bias, k, center=False))
  assert np.max(np.abs(raw - exact)) <= width * 1.01, (np.max(np.abs(raw - exact)), width)
  new = np.asarray(solve_bias(counts, bias, k))
  assert abs(float(new.mean())) < 1e-6
  np.testing.assert_allclose(new, raw - raw.mean(), atol=1e-6)
  # the raw quantile gives each expert its target count under the old cutoffs
  below = (r < raw[None, :]).sum(0)
  assert np.all(np.abs(below - target) <= np.asarray(counts).max(-1))


def test_solve_bias_jit_vmap_and_empty():
  layers, e, bins, k = 3, 8, 128, 2
  biases = np.random.default_rng(9).normal(size=(layers, e)).astype(np.float32) * 0.2
  counts = []
  for i in range(layers):
    scores = skewed_scores(256, e, seed=10 + i)
    alpha = route(scores, biases[i], k)[2]
    counts.append(np.asarray(histogram(scores, alpha, biases[i], bins)))
  counts = np.stack(counts)  # [layers, E, bins]
  stacked = np.asarray(jax.jit(jax.vmap(qb.solve_bias, in_axes=(0, 0, None)),
                               static_argnums=2)(counts, biases, k))
  for i in range(layers):
    np.testing.assert_allclose(stacked[i], np.asarray(solve_bias(counts[i], biases[i], k)),
                               atol=1e-6)
  np.testing.assert_allclose(stacked.mean(-1), 0.0, atol=1e-6)
  # no counted tokens (e.g. all padding): keep the old bias
  np.testing.assert_array_equal(
      np.asarray(solve_bias(np.zeros((e, bins), np.int32), biases[0], k)), biases[0])


def test_load_stats():
  idx = np.array([[0, 1], [0, 2], [0, 1], [3, 1]], np.int32)
  st = jax.jit(qb.load_stats, static_argnums=1)(idx, 5, np.array([True, True, False, True]))
  np.testing.assert_array_equal(np.asarray(st["load"]), [2, 2, 1, 1, 0])
  np.testing.assert_allclose(float(st["max_over_mean"]), 2 / (6 / 5), rtol=1e-6)
  np.testing.assert_allclose(float(st["min_over_mean"]), 0.0)


@jax.jit(static_argnums=(1, 2, 3, 4))
def _iterate(scores, k, steps, cutoff, bins):
  num_experts = scores.shape[-1]

  def step(bias, _):
    idx, _, alpha = qb.route(scores, bias, k)
    st = qb.load_stats(idx, num_experts)
    new = qb.solve_bias(qb.histogram(scores, alpha, bias, bins, cutoff=cutoff), bias, k)
    return new, (st["max_over_mean"], st["min_over_mean"])

  return jax.lax.scan(step, jnp.zeros((num_experts,), jnp.float32), None, length=steps)


def iterate(scores, k, steps, cutoff="k_plus_1", bins=1000):
  """route -> histogram -> solve_bias `steps` times on fixed scores, from b = 0.

  Returns the final bias and [(max/mean, min/mean) of the load routed with each step's bias].
  """
  bias, (mx, mn) = _iterate(scores, k, steps, cutoff, bins)
  return np.asarray(bias), list(zip(np.asarray(mx).tolist(), np.asarray(mn).tolist()))


@pytest.mark.parametrize("num_experts,k", [(16, 4), (64, 8)])
def test_converges_on_skewed_router(num_experts, k):
  scores = skewed_scores(4096, num_experts)
  bias, seq = iterate(scores, k, steps=10)
  print(f"\nE={num_experts} top-{k} max/mean (min/mean) per step:",
        " ".join(f"{a:.3f}({b:.2f})" for a, b in seq))
  assert seq[0][0] > 3.0  # the router really is skewed
  assert all(mx < 1.1 for mx, _ in seq[5:]), seq  # balanced within 5 steps, and stays so
  assert abs(float(np.mean(bias))) < 1e-5
  # the spec's cutoff stalls with some experts below target (see solve_bias); the
  # leave-one-out cutoff balances both ends
  _, seq_loo = iterate(scores, k, steps=10, cutoff="leave_one_out")
  print(f"E={num_experts} top-{k} leave_one_out:",
        " ".join(f"{a:.3f}({b:.2f})" for a, b in seq_loo))
  assert all(mx < 1.05 and mn > 0.95 for mx, mn in seq_loo[5:]), seq_loo

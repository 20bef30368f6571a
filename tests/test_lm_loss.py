"""The LM loss (k3jax/lm_loss.py): the chunked LM head + loss vs the whole logits, its
gradients taken in the forward (the head's matmuls counted), the target picked without a
scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.lm_loss import chunked_cross_entropy, cross_entropy


def _head(w, h):
  """A bare LM head: logits = h @ w."""
  return h @ w


def _head_problem():
  """h [2, 32, 16], an LM head [16, 64], targets, weights with zeros (padding)."""
  rng = np.random.default_rng(0)
  h = rng.normal(size=(2, 32, 16)).astype(np.float32)
  w = (rng.normal(size=(16, 64)) / 4).astype(np.float32)
  targets = rng.integers(0, 64, (2, 32)).astype(np.int32)
  weights = (rng.random((2, 32)) > 0.3).astype(np.float32)
  return h, w, targets, weights


@pytest.mark.parametrize("chunk", [4, 16, 32])
def test_chunked_cross_entropy_equals_whole_logits(chunk):
  """Loss and gradients (hidden states and head weights) of the chunked LM head + loss
  equal those of the whole logits, with the default denominator and a given one."""
  h, w, targets, weights = _head_problem()
  for denominator in (None, jnp.float32(57.0)):
    def whole(h, w):
      return cross_entropy(h @ w, targets, weights, denominator)

    def chunked(h, w):
      return chunked_cross_entropy(_head, w, h, targets, weights, denominator, chunk)

    ref, ref_grads = jax.jit(jax.value_and_grad(whole, argnums=(0, 1)))(h, w)
    got, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_the_kernel_in_chunks_equals_the_reference_whole():
  """`backend="interpret"` (the cross-entropy kernel) inside the chunked loss: the loss and
  gradients of the reference over the whole logits."""
  rng = np.random.default_rng(1)
  h = rng.normal(size=(2, 16, 16)).astype(np.float32)
  w = (rng.normal(size=(16, 256)) / 4).astype(np.float32)
  targets = rng.integers(0, 256, (2, 16)).astype(np.int32)
  weights = (rng.random((2, 16)) > 0.3).astype(np.float32)

  def loss(backend, chunk):
    return jax.jit(jax.value_and_grad(lambda h, w: chunked_cross_entropy(
        _head, w, h, targets, weights, None, chunk, backend), argnums=(0, 1)))(h, w)

  ref, ref_grads = loss("reference", 0)
  got, grads = loss("interpret", 8)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  for g, r in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_chunked_cross_entropy_never_forms_the_whole_logits():
  """With chunks of 8 no [B, T, V] = [2, 32, 64] array is in the compiled step (forward and
  backward); with chunk 0 it is."""
  h, w, targets, weights = _head_problem()

  def hlo(chunk):
    def loss(h, w):
      return chunked_cross_entropy(_head, w, h, targets, weights, None, chunk)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile().as_text()

  assert "f32[2,32,64]" in hlo(0)
  assert "f32[2,32,64]" not in hlo(8) and "f32[2,8,64]" in hlo(8)


def _matmuls(jaxpr) -> int:
  """dot_generals in a jaxpr and every jaxpr inside it (scans, custom VJPs, jits)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          count += _matmuls(inner)
  return count


@pytest.mark.parametrize("chunk", [0, 8])
def test_chunked_loss_runs_the_head_three_times_a_chunk(chunk):
  """Loss and gradients take three matmuls of the head, whole or chunked: the logits, the
  hidden states' and the weights' gradients; chunked, the backward computes no logits again
  (under remat it would: four)."""
  h, w, targets, weights = _head_problem()

  def loss(h, w):
    return chunked_cross_entropy(_head, w, h, targets, weights, None, chunk)

  assert _matmuls(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(h, w).jaxpr) == 3


def test_chunked_loss_without_gradients_runs_the_head_once():
  """Not differentiated (the eval step), the chunked loss computes the logits alone."""
  h, w, targets, weights = _head_problem()

  def loss(h, w):
    return chunked_cross_entropy(_head, w, h, targets, weights, None, 8)

  assert _matmuls(jax.make_jaxpr(loss)(h, w).jaxpr) == 1
  whole = cross_entropy(h @ w, targets, weights)
  np.testing.assert_allclose(jax.jit(loss)(h, w), whole, rtol=1e-6)


def test_cross_entropy_picks_the_target_without_a_scatter():
  """The loss and its gradient equal the gather form's bit for bit, and the gradient has no
  scatter (XLA's deterministic mode rewrites a scatter-add element by element)."""
  h, w, targets, weights = _head_problem()
  logits = jnp.asarray(h @ w)

  def gathered(logits):
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * weights) / jnp.maximum(jnp.sum(weights), 1.0)

  loss = lambda x: cross_entropy(x, targets, weights)  # noqa: E731
  for a, b in zip(jax.jit(jax.value_and_grad(loss))(logits),
                  jax.jit(jax.value_and_grad(gathered))(logits)):
    np.testing.assert_array_equal(a, b)
  prims = {e.primitive.name for e in jax.make_jaxpr(jax.grad(loss))(logits).jaxpr.eqns}
  assert not any(p.startswith("scatter") for p in prims), prims


def test_chunks_must_split_the_sequence():
  h, w, targets, weights = _head_problem()
  with pytest.raises(ValueError, match="32 positions do not split into chunks of 5"):
    chunked_cross_entropy(_head, w, h, targets, weights, None, 5)

"""Each position's cross-entropy (pallas_kernels/cross_entropy): the one-pass kernel (in
interpret mode here) against the XLA reference, values and gradients; the vocabulary split
over devices against the whole; its refusals. The same on a GPU: test_cross_entropy_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.cross_entropy import cross_entropy, cross_entropy_pallas


def problem(shape=(3, 5, 768), dtype=jnp.float32, seed=0):
  """logits [B, T, V] (one row's first half -inf: the kernel's first blocks see only -inf),
  targets in the finite half and one outside [0, V) (it picks nothing), a cotangent per
  position."""
  b, t, v = shape
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  logits = 4.0 * jax.random.normal(k1, shape, jnp.float32)
  logits = logits.at[0, 1, : v // 2].set(-jnp.inf).astype(dtype)
  targets = jax.random.randint(k2, (b, t), v // 2, v).at[1, 2].set(v + 3)
  return logits, targets, jax.random.normal(k3, (b, t))


def value_and_grad(backend, logits, targets, cot, **where):
  def loss(logits):
    return jnp.sum(cross_entropy(logits, targets, backend=backend, **where) * cot)
  return jax.jit(jax.value_and_grad(loss))(logits), cross_entropy(logits, targets,
                                                                   backend=backend, **where)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_reference(dtype):
  """Per-position values, their weighted sum and the logits' gradient agree to fp32
  rounding (the kernel sums the vocabulary in another order), on fp32 and bf16 logits."""
  logits, targets, cot = problem(dtype=dtype)
  (ref, ref_grad), ref_nll = value_and_grad("reference", logits, targets, cot)
  (got, got_grad), got_nll = value_and_grad("interpret", logits, targets, cot)
  np.testing.assert_allclose(got_nll, ref_nll, rtol=1e-6)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  assert got_grad.dtype == logits.dtype
  tol = 1e-6 if dtype == jnp.float32 else 8e-3   # bf16: one rounding of the gradient
  np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(ref_grad, np.float32),
                             rtol=tol, atol=1e-7)


def test_rows_of_minus_inf_give_what_the_reference_gives():
  """A row all -inf (NaN, as -inf - -inf in the reference), one whose first blocks are all
  -inf (the running sum starts at its first finite block), one whose target is -inf (inf)."""
  logits = jnp.full((4, 512), -jnp.inf).at[1:, 300].set(2.0).at[3, 301].set(1.0)
  targets = jnp.array([5, 300, 299, 300])
  got = cross_entropy_pallas(logits, targets, interpret=True)
  np.testing.assert_array_equal(got, cross_entropy(logits, targets))
  np.testing.assert_array_equal(np.isnan(got), [True, False, False, False])


def test_vocabulary_split_over_devices_equals_the_whole():
  """With the vocabulary split four ways (and the rows two ways) each device's kernel reads
  its piece and the pieces combine: the same values and gradient as one device."""
  logits, targets, cot = problem((2, 4, 4 * 256))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
  where = dict(mesh=mesh, batch_axis="data", vocab_axis="tensor")
  sharded = jax.device_put(logits, jax.NamedSharding(mesh, P("data", None, "tensor")))
  (ref, ref_grad), ref_nll = value_and_grad("reference", logits, targets, cot)
  (got, got_grad), got_nll = value_and_grad("interpret", sharded, targets, cot, **where)
  np.testing.assert_allclose(got_nll, ref_nll, rtol=1e-6)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  np.testing.assert_allclose(got_grad, ref_grad, rtol=1e-6, atol=1e-7)


def _lowered_for(platform, logits, targets):
  return jax.jit(lambda x: cross_entropy(x, targets, backend="auto", platform=platform)).trace(
      logits).lower(lowering_platforms=(platform,)).as_text().lower()


def test_auto_takes_the_kernel_on_gpus_only_and_where_blocks_divide():
  logits, targets, _ = problem((1, 3, 256))
  assert "triton" in _lowered_for("cuda", logits, targets)
  assert "triton" not in _lowered_for("cpu", logits, targets)
  logits, targets, _ = problem((1, 3, 100))
  assert "triton" not in _lowered_for("cuda", logits, targets)  # no blocks fit 100
  with pytest.raises(ValueError, match="a vocabulary of 100 entries"):
    cross_entropy_pallas(logits, targets, interpret=True)
  with pytest.raises(ValueError, match="unknown cross-entropy backend 'triton'"):
    cross_entropy(logits, targets, backend="triton")

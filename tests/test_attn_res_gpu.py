"""The Block AttnRes read's Triton kernels compiled for the GPU they run on (skipped
elsewhere) against the reference: fp32 to fp32 rounding, bf16 sources as accurate as the
reference's own bf16 rounding. conftest.py selects the CPU unless told otherwise:

  JAX_PLATFORMS=cuda python -m pytest tests/test_attn_res_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel
from pallas_kernels.attn_res import attend, attend_pallas, attend_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _value_and_grads(fn, sources, valid, query, gain, dh):
  def loss(sources, query, gain):
    return jnp.sum(fn(sources, valid, query, gain, 1e-5).astype(jnp.float32) *
                   dh.astype(jnp.float32))
  return (fn(sources, valid, query, gain, 1e-5),) + jax.jit(jax.grad(
      loss, argnums=(0, 1, 2)))(sources, query, gain)


@pytest.mark.parametrize("dtype,separate", [(jnp.float32, False), (jnp.bfloat16, False),
                                            (jnp.float32, True), (jnp.bfloat16, True)])
def test_kernels_match_the_reference_on_gpu(dtype, separate):
  """The sources as one buffer (the last slot masked) or as four separate arrays."""
  rng = np.random.default_rng(0)
  S, B, T, d = 5, 2, 1024, 2048
  sources = jnp.asarray(2 * rng.standard_normal((S, B, T, d)), dtype)
  dh = jnp.asarray(rng.standard_normal((B, T, d)), dtype)
  query = jnp.asarray(0.1 * rng.standard_normal(d), jnp.float32)
  gain = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
  valid = jnp.asarray([1, 1, 1, 1, 0], bool)
  if separate:
    sources, valid = [sources[s] for s in range(S - 1)], None
  assert "pallas_call" in str(jax.make_jaxpr(
      lambda s: attend(s, valid, query, gain, 1e-5, backend="auto"))(sources))
  got = jax.tree.leaves(_value_and_grads(attend_pallas, sources, valid, query, gain, dh))
  if dtype == jnp.float32:
    want = jax.tree.leaves(_value_and_grads(attend_reference, sources, valid, query, gain, dh))
    for a, b in zip(got, want, strict=True):
      assert rel(a, b) < 1e-5
    return
  exact = jax.tree.leaves(_value_and_grads(
      attend_reference, jax.tree.map(lambda s: s.astype(jnp.float32), sources), valid, query,
      gain, dh.astype(jnp.float32)))
  ref = jax.tree.leaves(_value_and_grads(attend_reference, sources, valid, query, gain, dh))
  for a, b, e in zip(got, ref, exact, strict=True):
    assert rel(a, e) <= 1.5 * rel(b, e) + 1e-6

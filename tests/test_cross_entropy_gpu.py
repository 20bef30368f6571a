"""The cross-entropy kernel compiled for the GPU it runs on (skipped elsewhere) against the
reference, at the LM head's shape class: bf16 logits of a 128-multiple vocabulary.
conftest.py selects the CPU unless told otherwise:

  JAX_PLATFORMS=cuda python -m pytest tests/test_cross_entropy_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_cross_entropy_kernel import problem, value_and_grad

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("shape", [(2, 64, 32768), (1, 6, 4224), (4, 512, 163840)])
def test_kernel_equals_the_reference_on_the_gpu(shape):
  logits, targets, cot = problem(shape, jnp.bfloat16)
  (ref, ref_grad), ref_nll = value_and_grad("reference", logits, targets, cot)
  (got, got_grad), got_nll = value_and_grad("kernel", logits, targets, cot)
  finite = np.isfinite(np.asarray(ref_nll))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got_nll)), finite)
  np.testing.assert_allclose(np.asarray(got_nll)[finite], np.asarray(ref_nll)[finite],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_grad, np.float32), np.asarray(ref_grad, np.float32),
                             rtol=8e-3, atol=1e-7)

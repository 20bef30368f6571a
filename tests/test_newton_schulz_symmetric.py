"""Newton-Schulz's symmetric products (pallas_kernels/newton_schulz/symmetric.py): the CTA
tiles cover each tile on and above the diagonal once; the standard form on the reference
product vs the fp32 oracle; the dispatcher's "symmetric" backend; the Mosaic GPU kernel
lowers for CUDA from this CPU (shared memory checked there); on a GPU, kernel vs reference
(JAX 0.10's Mosaic GPU interpreter cannot run transposed operands):

  JAX_PLATFORMS=cuda python -m pytest tests/test_newton_schulz_symmetric.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel
from pallas_kernels.newton_schulz import newton_schulz, newton_schulz_reference
from pallas_kernels.newton_schulz import symmetric

MOSAIC_CALL = "mosaic_gpu"


@pytest.mark.parametrize("m", [256, 768, 1024])
def test_cta_tiles_cover_the_upper_triangle_once(m):
  tiles = symmetric.upper_tiles(m)
  rows, pairs = np.split(tiles, 2)
  covered = [(i, j) for i, p in zip(rows, pairs) for j in (2 * p, 2 * p + 1) if j >= i]
  t = m // symmetric.TILE
  assert sorted(covered) == [(i, j) for i in range(t) for j in range(i, t)]


def test_form_matches_the_oracle():
  """The standard form on the fp32 products rounded once to bf16 stays within bf16's error
  of the fp32 oracle, and well under XLA's bf16 form (which rounds A, A A and the sum)."""
  x = jax.random.normal(jax.random.key(0), (2, 512, 256), jnp.float32)
  oracle = newton_schulz_reference(x)
  xb = x.astype(jnp.bfloat16)
  form = symmetric.newton_schulz_symmetric(xb, product=symmetric.symmetric_product_reference)
  plain_bf16 = newton_schulz(xb, backend="reference")
  assert form.shape == x.shape and form.dtype == jnp.bfloat16
  assert rel(form, oracle) < 0.5 * rel(plain_bf16, oracle)
  assert rel(form, oracle) < 2e-2


def test_dispatch():
  """"symmetric" takes bf16 blocks whose short side is a multiple of 256: on a GPU the
  kernel's form, elsewhere (and for other blocks) what "reference" / "auto" give."""
  assert symmetric.fits((3, 768, 1024), jnp.bfloat16)
  assert symmetric.fits((1024, 768), jnp.bfloat16)
  assert not symmetric.fits((768, 1024), jnp.float32)
  assert not symmetric.fits((128, 2048), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (2, 256, 320), jnp.float32).astype(jnp.bfloat16)
  got = newton_schulz(x, backend="symmetric")
  if jax.default_backend() == "gpu":  # the kernel's form
    assert rel(got, newton_schulz_reference(x.astype(jnp.float32))) < 2e-2
  else:
    np.testing.assert_array_equal(got, newton_schulz(x, backend="reference"))
  narrow = x[:, :128]
  np.testing.assert_array_equal(newton_schulz(narrow, backend="symmetric"),
                                newton_schulz(narrow, backend="auto"))


def test_errors_name_the_shape():
  x = jnp.zeros((2, 200, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 256"):
    symmetric.symmetric_product(x)
  good = jnp.zeros((2, 256, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="y must be"):
    symmetric.symmetric_product(good, good[:1])


@pytest.mark.parametrize("with_y", [False, True])
def test_kernel_lowers_for_cuda(with_y):
  """At k3_small's expert blocks (768 x 1024 products, 768 x 768 polynomial)."""
  sd = jax.ShapeDtypeStruct
  k = 768 if with_y else 1024
  args = (sd((4, 768, k), jnp.bfloat16),) + ((sd((4, 768, 768), jnp.bfloat16),) if with_y
                                             else ())
  kw = dict(alpha=2.0, beta=-4.0, gamma=3.0) if with_y else {}
  text = jax.jit(lambda *a: symmetric.symmetric_product(*a, num_sms=132, **kw)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(MOSAIC_CALL) >= 1


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels run on a GPU")
@pytest.mark.parametrize("shape", [(3, 512, 320), (2, 768, 1024)])
def test_kernel_matches_reference_on_gpu(shape):
  x = (jax.random.normal(jax.random.key(2), shape, jnp.float32) / 8).astype(jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(symmetric.symmetric_product(x), np.float32),
                             np.asarray(symmetric.symmetric_product_reference(x), np.float32),
                             rtol=1e-2, atol=1e-2)
  a = symmetric.symmetric_product_reference(x)
  kw = dict(alpha=2.0315, beta=-4.775, gamma=3.4445)
  np.testing.assert_allclose(
      np.asarray(symmetric.symmetric_product(a, a, **kw), np.float32),
      np.asarray(symmetric.symmetric_product_reference(a, a, **kw), np.float32),
      rtol=1e-2, atol=1e-2)

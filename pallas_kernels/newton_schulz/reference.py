"""Newton-Schulz orthogonalization in plain JAX: the standard quintic form (K3_SPEC 5).

Every trailing [m, n] block of x is orthogonalized on its own. The block is divided by its
Frobenius norm (plus eps), transposed when m > n so that the Gram matrix is the small one,
and then `steps` times

    A = X X^T,    X <- a X + (b A + c A A) X.

`newton_schulz_reference` does all of it in float32 at full matmul precision: it is the
oracle the kernels are tested against (and equals `optax.contrib`'s
`orthogonalize_via_newton_schulz` on a 2-D block). `newton_schulz_xla` is the same
standard form as fast code runs it: in the input's dtype (bf16 stays bf16, each matmul
accumulating in float32), identical to the reference for float32 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

COEFFS = (3.4445, -4.7750, 2.0315)  # K3_SPEC 5: quintic, maximal slope at zero
STEPS = 5
EPS = 1e-7
_HI = jax.lax.Precision.HIGHEST


def short_wide(x):
  """[..., m, n] -> ([..., min, max], transposed): the iteration runs on short-wide blocks."""
  if x.shape[-2] > x.shape[-1]:
    return jnp.swapaxes(x, -1, -2), True
  return x, False


def _standard_form(x, *, steps, coeffs, eps, dtype, precision):
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n] blocks, got shape {x.shape}")
  a, b, c = coeffs
  out_dtype = x.dtype
  x, transposed = short_wide(x)
  x = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = (x / (norm + eps)).astype(dtype)

  def mm(u, v):  # [..., p, q] @ [..., q, r] -> dtype (the matmul accumulates in float32)
    return jnp.matmul(u, v, precision=precision, preferred_element_type=dtype)

  for _ in range(steps):
    gram = mm(x, jnp.swapaxes(x, -1, -2))  # [..., m, m]
    poly = b * gram + c * mm(gram, gram)
    x = a * x + mm(poly, x)
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  return x.astype(out_dtype)


def newton_schulz_reference(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS):
  """The standard form, all in float32 at HIGHEST precision (the test oracle).

  Args:
    x: [..., m, n], any float dtype; each trailing block is orthogonalized on its own.
  Returns:
    [..., m, n] in x's dtype.
  """
  return _standard_form(x, steps=steps, coeffs=coeffs, eps=eps, dtype=jnp.float32,
                        precision=_HI)


def newton_schulz_xla(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS):
  """The standard form in x's dtype, as Muon implementations usually run it ("plain XLA NS5",
  like optax): a bf16 x stays bf16 throughout (matmuls accumulate in float32 inside and round
  their results to bf16); a float32 x gives exactly `newton_schulz_reference`.

  Args:
    x: [..., m, n].
  Returns:
    [..., m, n] in x's dtype.
  """
  dtype = x.dtype if x.dtype == jnp.bfloat16 else jnp.float32
  return _standard_form(x, steps=steps, coeffs=coeffs, eps=eps, dtype=dtype,
                        precision=_HI if dtype == jnp.float32 else None)

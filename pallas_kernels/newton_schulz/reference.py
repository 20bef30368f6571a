"""Newton-Schulz in plain JAX, the standard quintic form (K3_SPEC 5): per trailing [m, n]
block, X = x / (||x||_F + eps) made short-wide, then `steps` times X <- a X + (b A + c A A) X
with A = X X^T, computed as (a I + b A + c A A) X."""

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


def standard_form(x, *, steps, coeffs, eps, dtype, precision=None, polynomial=None):
  """X = x / (||x||_F + eps) short-wide in dtype, `steps` times X <- P X, out in x's dtype.
  polynomial(X, coeffs) -> P = a I + b A + c A A for A = X X^T; default: XLA's matmuls."""
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n] blocks, got shape {x.shape}")
  out_dtype = x.dtype
  x, transposed = short_wide(x)
  x = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = (x / (norm + eps)).astype(dtype)

  def mm(u, v):
    return jnp.matmul(u, v, precision=precision, preferred_element_type=dtype)

  def xla_polynomial(x, coeffs):
    a, b, c = coeffs
    gram = mm(x, jnp.swapaxes(x, -1, -2))
    return c * mm(gram, gram) + (b * gram + a * jnp.eye(x.shape[-2], dtype=dtype))

  # a X + (b A + c A A) X as (a I + b A + c A A) X: one pass over the [m, m] polynomial, none
  # over X between the matmuls
  polynomial = polynomial or xla_polynomial
  for _ in range(steps):
    x = mm(polynomial(x, coeffs), x)
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  return x.astype(out_dtype)


def newton_schulz_reference(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS):
  """The standard form in fp32 at HIGHEST: the test oracle (optax's on a 2-D block)."""
  return standard_form(x, steps=steps, coeffs=coeffs, eps=eps, dtype=jnp.float32,
                        precision=_HI)


def newton_schulz_xla(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS):
  """The standard form in x's dtype, as optax runs it: bf16 stays bf16 between matmuls; fp32
  x gives `newton_schulz_reference` exactly."""
  dtype = x.dtype if x.dtype == jnp.bfloat16 else jnp.float32
  return standard_form(x, steps=steps, coeffs=coeffs, eps=eps, dtype=dtype,
                        precision=_HI if dtype == jnp.float32 else None)

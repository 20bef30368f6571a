"""The Gram form of Newton-Schulz (K3_SPEC 5): iterate on the small [m, m] matrix, apply once.

For a short-wide block X0 [m, n] (m <= n), every quintic step multiplies X on the left by a
polynomial of its own Gram matrix: X_{k+1} = P_k X_k with P_k = a I + b A_k + c A_k^2 and
A_k = X_k X_k^T. Hence

    A_0 = X0 X0^T / s^2,   s = ||X0||_F + eps      (||X0||_F^2 = trace(X0 X0^T))
    P_k = a I + b A_k + c A_k^2
    A_{k+1} = P_k A_k P_k                          (P_k is a polynomial of A_k: they commute)
    out = (P_{steps-1} ... P_0 / s) X0

the same polynomial as the standard form in exact arithmetic. X0 is read twice (once for the
Gram matrix, once for the product) instead of twice per step, and the iteration costs about
17 m^3-sized matmuls instead of 10 (m^2 n)-sized ones, so it pays for m << n.

The Gram matrix squares the condition number (float32 errors grow like cond^2 * 2^-24), so
the [m, m] iteration always runs with float32 accumulation (HIGHEST; or, where a caller
chooses it for bf16 inputs, bf16x3 at about 2^-16 or tf32 at about 2^-11 relative per
product), and for bf16 inputs the final product
uses q as two bf16 parts (hi + lo): a lone bf16 q would err by about 2^-9 times the block's
condition number.

`gram_matrix_polynomial` is written with 2-D-safe operations only (iota, single-axis sums)
so that the Pallas kernels (Mosaic TPU, Triton) run the very same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.newton_schulz.reference import COEFFS, EPS, STEPS, short_wide

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def dot_f32(u, v):
  """[p, q] @ [q, r] in float32 at full precision."""
  return jax.lax.dot_general(u, v, (((u.ndim - 1,), (v.ndim - 2,)), ((), ())),
                             precision=_HI, preferred_element_type=_F32)


def split_bf16(u):
  """float32 u -> (hi, lo) bf16 with hi + lo = u to about 2^-17 relative."""
  hi = u.astype(jnp.bfloat16)
  return hi, (u - hi.astype(_F32)).astype(jnp.bfloat16)


def gram_matrix_polynomial(gram, *, steps=STEPS, coeffs=COEFFS, eps=EPS, dot=dot_f32):
  """The accumulated Newton-Schulz polynomial of one block, normalization included.

  Args:
    gram: [m, m] float32, X0 X0^T of the unnormalized block (zero-padded rows are fine:
      their rows and columns stay zero apart from the diagonal, and never mix in).
    dot: the [m, m] @ [m, m] float32 product to use (e.g. `dot_f32`).
  Returns:
    q [m, m] float32 with out = q @ X0.
  """
  a, b, c = coeffs
  m = gram.shape[-1]
  row = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
  eye = (row == col).astype(_F32)
  sq_norm = jnp.sum(jnp.sum(gram * eye, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
  inv = 1.0 / (jnp.sqrt(sq_norm) + eps)
  g = gram * (inv * inv)
  q = eye
  for k in range(steps):
    p = a * eye + b * g + c * dot(g, g)
    q = p if k == 0 else dot(p, q)
    if k + 1 < steps:  # the last step's Gram matrix is never used
      g = dot(p, dot(p, g))
  return q * inv


def newton_schulz_gram_xla(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, iterate_precision=None):
  """The Gram form in plain XLA (batched einsums), for [..., m, n] blocks.

  The Gram matrix and the final product take x's dtype (bf16, else float32) as operands with
  float32 accumulation; the [m, m] iteration runs in float32 at `iterate_precision` (default:
  HIGHEST for float32 x, bf16x3 otherwise; any `jax.lax` precision or DotAlgorithmPreset).

  Returns:
    [..., m, n] in x's dtype.
  """
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n] blocks, got shape {x.shape}")
  out_dtype = x.dtype
  x = x if x.dtype == jnp.bfloat16 else x.astype(_F32)
  exact = x.dtype == _F32
  if iterate_precision is None:
    iterate_precision = _HI if exact else jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  xs, transposed = short_wide(x)
  lead, (m, n) = xs.shape[:-2], xs.shape[-2:]
  xs = xs.reshape((-1, m, n))
  op_precision = _HI if exact else None
  gram = jnp.einsum("bmn,bkn->bmk", xs, xs, precision=op_precision,
                    preferred_element_type=_F32)

  def dot(u, v):
    return jnp.matmul(u, v, precision=iterate_precision, preferred_element_type=_F32)

  poly = jax.vmap(lambda g: gram_matrix_polynomial(g, steps=steps, coeffs=coeffs, eps=eps,
                                                   dot=dot))
  q = poly(gram)
  apply = lambda u: jnp.einsum("bmk,bkn->bmn", u.astype(xs.dtype), xs, precision=op_precision,
                               preferred_element_type=_F32)
  if exact:
    out = apply(q)
  else:  # q as bf16 hi + lo: a lone bf16 q would cost ~2^-9 times the condition number
    q_hi, q_lo = split_bf16(q)
    out = apply(q_lo) + apply(q_hi)
  out = out.astype(out_dtype).reshape(lead + (m, n))
  return jnp.swapaxes(out, -1, -2) if transposed else out

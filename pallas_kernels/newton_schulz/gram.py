"""The Gram form of Newton-Schulz (K3_SPEC 5) for short-wide X0 [m, n], s = ||X0||_F + eps:
    A_0 = X0 X0^T / s^2,  P_k = a I + b A_k + c A_k^2,  A_{k+1} = P_k A_k P_k,
    out = (P_{steps-1} ... P_0 / s) X0.
The Gram matrix squares the condition number: the iteration accumulates in fp32, and bf16
inputs apply q as bf16 hi + lo (a lone bf16 q errs by ~2^-9 cond)."""

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
  """q [m, m] fp32 with out = q @ X0, from gram = X0 X0^T [m, m] fp32 (zero-padded rows
  never mix in); dot: the [m, m] product."""
  a, b, c = coeffs
  m = gram.shape[-1]
  row = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
  eye = (row == col).astype(_F32)
  sq_norm = jnp.sum(jnp.sum(gram * eye, axis=1, keepdims=True), axis=0, keepdims=True)
  inv = 1.0 / (jnp.sqrt(sq_norm) + eps)
  g = gram * (inv * inv)
  q = eye
  for k in range(steps):
    p = a * eye + b * g + c * dot(g, g)
    q = p if k == 0 else dot(p, q)
    if k + 1 < steps:
      g = dot(p, dot(p, g))
  return q * inv


def newton_schulz_gram_xla(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, iterate_precision=None):
  """The Gram form in plain XLA; the iteration at iterate_precision (default HIGHEST / bf16x3)."""
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
  else:
    q_hi, q_lo = split_bf16(q)
    out = apply(q_lo) + apply(q_hi)
  out = out.astype(out_dtype).reshape(lead + (m, n))
  return jnp.swapaxes(out, -1, -2) if transposed else out

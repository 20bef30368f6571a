"""KDA's short convolution in plain JAX: the reference, and the path on TPU and CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
EPS = 1e-6  # added to the sum of squares of the L2 norm


def check_shapes(x: jax.Array, weight: jax.Array, segment_ids: jax.Array):
  """ValueError unless weight is [W, H, D], segment_ids [B, T] (broadcasting hides errors)."""
  B, T, H, D = x.shape
  if weight.ndim != 3 or weight.shape[1:] != (H, D) or segment_ids.shape != (B, T):
    raise ValueError(f"short_conv: x {x.shape} needs weight [W, {H}, {D}] and segment_ids "
                     f"[{B}, {T}]; got {weight.shape} and {segment_ids.shape}")


def short_conv_reference(x: jax.Array, weight: jax.Array, segment_ids: jax.Array, *,
                         normalize: bool = False) -> jax.Array:
  """silu(causal depthwise conv of x [B, T, H, D]) in x's dtype, L2-normalized over D if
  `normalize`; tap j of weight [W, H, D] reads x[t - j] of the same document. fp32 inside:
  the taps' gradients sum over all B x T positions."""
  check_shapes(x, weight, segment_ids)
  xf, weight = x.astype(F32), weight.astype(F32)
  out = xf * weight[0]
  for j in range(1, weight.shape[0]):
    shifted = jnp.pad(xf, ((0, 0), (j, 0), (0, 0), (0, 0)))[:, :-j]
    same_doc = jnp.pad(segment_ids, ((0, 0), (j, 0)), constant_values=-1)[:, :-j] == segment_ids
    out = out + jnp.where(same_doc[..., None, None], shifted, 0) * weight[j]
  out = jax.nn.silu(out)
  if normalize:
    out = out * jax.lax.rsqrt(jnp.sum(out * out, axis=-1, keepdims=True) + EPS)
  return out.astype(x.dtype)

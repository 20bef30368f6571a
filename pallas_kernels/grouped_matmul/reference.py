"""Grouped matmuls in plain JAX (`jax.lax.ragged_dot`): the reference, and the TPU and CPU
path. Group g owns group_sizes[g] consecutive rows; rows past the groups belong to none."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        transpose_rhs: bool = False) -> jax.Array:
  """out[i] = lhs[i] @ rhs[g(i)] (transposed if transpose_rhs): [M, K] x [G, K, N] -> [M, N]."""
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """out[g] = lhs[rows of g]^T @ rhs[rows of g], `gmm`'s weight gradient: -> [G, K, N]."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)

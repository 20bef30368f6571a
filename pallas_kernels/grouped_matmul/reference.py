"""Grouped matmuls in plain JAX (`jax.lax.ragged_dot`): the reference, and the path on TPU
(where XLA compiles `ragged_dot` to its grouped-matmul kernels) and CPU.

Rows of `lhs` are sorted by group: group g owns group_sizes[g] consecutive rows from
sum(group_sizes[:g]); rows past sum(group_sizes) belong to no group. Results are in the
operands' dtype, as `ragged_dot` and its autodiff give them (XLA accumulates 16-bit
products in fp32): the same program on TPU as before this op existed, whose memory the
k3_full AOT rows record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        transpose_rhs: bool = False) -> jax.Array:
  """out[i] = lhs[i] @ rhs[g(i)] (rhs[g(i)]^T if transpose_rhs), zero for rows in no group.

  lhs [M, K]; rhs [G, K, N] ([G, N, K] if transpose_rhs); group_sizes [G] int32.
  Returns [M, N] in the operands' dtype.
  """
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """out[g] = lhs[rows of g]^T @ rhs[rows of g]: the weight gradient of `gmm`.

  lhs [M, K]; rhs [M, N]; group_sizes [G] int32. Returns [G, K, N] in the operands' dtype
  (zero for an empty group).
  """
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)

"""Routed-expert dispatch of Stable LatentMoE (K3_SPEC 4): latent z + routing -> u.

  "dropless" (`dropless_moe`): the (token, slot) pairs are sorted by expert and the experts
      run as grouped matmuls (`jax.lax.ragged_dot`); nothing is dropped.
  "capacity" (`capacity_moe`): each expert gets a fixed buffer of `capacity` pairs per
      sequence, buffers [E, rows, C, L], and runs as one batched matmul; pairs beyond a
      buffer are dropped, later positions first.

Both take the expert computation as a function (`ExpertsFn`, `BufferExpertsFn`): the
piece that `expert_parallel` wraps in an all-to-all. Shapes: N tokens (rows * T, row-major),
k slots per token, E experts, L latent width, H expert hidden width, C capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

DISPATCHES = ("dropless", "capacity", "expert_parallel")  # moe.dispatch (expert_parallel.py)
ExpertsFn = Callable[[jax.Array, jax.Array], jax.Array]
BufferExpertsFn = Callable[[jax.Array], jax.Array]


def dropless_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, experts: ExpertsFn,
                 num_experts: int) -> jax.Array:
  """u = sum_k weights[:, k] * experts(z)[token, idx[:, k]] without dropping tokens.

  z: [N, L]; idx: [N, k] int32; weights: [N, k] fp32. `experts(rows, group_sizes)` maps
  rows [N*k, L] sorted by expert (group_sizes [E] rows per expert, in expert order) to
  [N*k, L]. Returns u [N, L] fp32.
  """
  n, k = idx.shape
  flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
  order = jnp.argsort(flat, stable=True)  # [N*k] pair positions grouped by expert
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  out_sorted = experts(jnp.take(z, order // k, axis=0), group_sizes)  # [N*k, L]
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
  out = jnp.take(out_sorted, inverse, axis=0).reshape(n, k, -1)  # [N, k, L]
  return jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32), out.astype(jnp.float32))


def _rank_in_expert(flat: jax.Array, num_experts: int) -> jax.Array:
  """[M] position of each pair among the pairs of its group (expert), in pair order."""
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts)
  starts = jnp.cumsum(sizes) - sizes  # [E] first sorted position of each expert
  rank_sorted = jnp.arange(flat.shape[0]) - starts[flat[order]]
  return jnp.zeros_like(flat).at[order].set(rank_sorted.astype(flat.dtype))


def capacity_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, experts: BufferExpertsFn,
                 num_experts: int, num_rows: int, capacity: int):
  """Fixed-buffer dispatch: u = sum_k weights * E_idx(z) over the pairs that fit.

  z: [N, L] with N = num_rows * T tokens, row-major; idx, weights: [N, k]. Each expert
  takes at most `capacity` pairs from each row, earlier positions first, so whether a
  token is dropped depends only on earlier tokens of its own sequence: dispatch stays
  causal and rows never affect each other. `experts` maps the buffers [E, rows, C, L]
  (z's dtype; empty slots are zero) to outputs of the same shape.
  Returns (u [N, L] fp32, kept [N, k] bool).
  """
  n, k = idx.shape
  row = jnp.arange(n * k) // (n // num_rows * k)  # [N*k] sequence of each pair
  group = row * num_experts + idx.reshape(-1)  # [N*k] (row, expert) buffer of each pair
  rank = _rank_in_expert(group, num_rows * num_experts)
  kept = rank < capacity
  slot = jnp.where(kept, group * capacity + rank, num_rows * num_experts * capacity)
  pairs_in = jnp.repeat(z, k, axis=0)  # [N*k, L], pair order
  buf = jnp.zeros((num_rows * num_experts * capacity, z.shape[-1]), z.dtype)
  buf = buf.at[slot].set(pairs_in, mode="drop")  # overflow slot: dropped
  buf = buf.reshape(num_rows, num_experts, capacity, -1).swapaxes(0, 1)  # [E, rows, C, L]
  out = experts(buf).swapaxes(0, 1).reshape(num_rows * num_experts * capacity, -1)
  pairs = out.at[slot].get(mode="fill", fill_value=0)  # [N*k, L]; dropped pairs give 0
  u = jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32),
                 pairs.reshape(n, k, -1).astype(jnp.float32))
  return u, kept.reshape(n, k)


def ragged_glu_experts(w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act, dtype) -> ExpertsFn:
  """Grouped GLU experts: rows [M, L] sorted by expert -> [M, L] in `dtype`.

  w_g, w_u: [E, L, H]; w_d: [E, H, L]; act: the fp32 GLU activation (g, v) -> h.
  """
  def run(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = rows.astype(dtype)
    g = jax.lax.ragged_dot(rows, w_g.astype(dtype), group_sizes)  # [M, H]
    v = jax.lax.ragged_dot(rows, w_u.astype(dtype), group_sizes)  # [M, H]
    h = act(g, v).astype(dtype)
    return jax.lax.ragged_dot(h, w_d.astype(dtype), group_sizes)  # [M, L]
  return run


def batched_glu_experts(w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act,
                        dtype) -> BufferExpertsFn:
  """GLU experts on buffers: [E, R, C, L] -> [E, R, C, L] in `dtype`, one batched matmul each.

  w_g, w_u: [E, L, H]; w_d: [E, H, L]; act: the fp32 GLU activation (g, v) -> h. With H
  split across devices (w_g, w_u, w_d holding a slice of it) the result is this slice's
  partial sum of the output.
  """
  def run(buf: jax.Array) -> jax.Array:
    buf = buf.astype(dtype)
    g = jnp.einsum("erck,ekh->erch", buf, w_g.astype(dtype))
    v = jnp.einsum("erck,ekh->erch", buf, w_u.astype(dtype))
    return jnp.einsum("erch,ehk->erck", act(g, v).astype(dtype), w_d.astype(dtype))
  return run

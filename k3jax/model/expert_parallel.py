"""Expert-parallel dispatch (K3_SPEC 4) under `jax.shard_map`: the all-to-all carries the latent z.

"expert_parallel": each device builds capacity buffers [E, rows_local, C, L] from its rows,
all-to-alls them over the `experts` axis, runs its E/ep experts and sends them back; only
latent-wide buffers cross. Expert stacks enter sharded: L all-gathered inside (gradient
reduce-scattered), H split over tensor and psum'd after the combine. "expert_parallel_dropless"
(TPU, GPU) does the same with ragged all-to-alls. Without a mesh: the moe_dispatch functions."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

import jax.numpy as jnp

from k3jax import axes
from k3jax.model.moe_dispatch import (batched_glu_experts, capacity_moe, dropless_moe,
                                      ragged_glu_experts)


def experts_split(mesh) -> bool:
  """Whether the rules split the experts over devices of `mesh` (None: no)."""
  if mesh is None:
    return False
  ep = axes.mesh_axes("experts")
  return math.prod(mesh.shape[name] for name in ep) > 1


def expert_parallel_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, w_g: jax.Array,
                        w_u: jax.Array, w_d: jax.Array, act, dtype, capacity: int):
  """The capacity dispatch with experts split over the mesh axis of `experts`.
  z: [B, T, L]; idx, weights: [B, T, k]; w_g, w_u: [E, L, H]; w_d: [E, H, L]; capacity:
  pairs per expert per (local slice of a) row. Returns (u [B, T, L] fp32, kept [B, T, k]),
  equal to `capacity_moe`'s."""
  b, t, k = idx.shape
  num_experts = w_g.shape[0]
  mesh = axes.current_mesh()
  if mesh is None:
    experts = batched_glu_experts(w_g, w_u, w_d, act, dtype)
    u, kept = capacity_moe(z.reshape(b * t, -1).astype(dtype), idx.reshape(b * t, k),
                           weights.reshape(b * t, k), experts, num_experts, b, capacity)
    return u.reshape(b, t, -1), kept.reshape(b, t, k)
  batch, ep, lat, hid = _layout(mesh, num_experts, "expert_parallel")
  seq = axes.mesh_axes("seq")

  def local(z, idx, weights, w_g, w_u, w_d):
    """One device: its rows [b_loc, t_loc, ...], its experts [E/ep, L/fsdp, H/tensor]."""
    bl, t = z.shape[:2]
    w_g, w_u, w_d = _gather_latent(w_g, w_u, w_d, dtype, lat)
    run = batched_glu_experts(w_g, w_u, w_d, act, dtype)

    def experts(buf):  # [E, b_loc, C, L] -> the same, computed by the experts' owners
      if not ep:
        return run(buf)
      buf = jax.lax.all_to_all(buf, ep[0], 0, 1, tiled=True)  # [E/ep, ep * b_loc, C, L]
      return jax.lax.all_to_all(run(buf), ep[0], 1, 0, tiled=True)

    z = z.reshape(bl * t, -1).astype(dtype)
    if hid:
      # Varying here puts the backward's sum over tensor on dz, not on the larger buffers.
      z = jax.lax.pcast(z, hid, to="varying")
    u, kept = capacity_moe(z, idx.reshape(bl * t, k), weights.reshape(bl * t, k), experts,
                           num_experts, bl, capacity)
    if hid:
      u = jax.lax.psum(u, hid)  # the partial sums of each tensor peer's slice of H
    return u.reshape(bl, t, -1), kept.reshape(bl, t, k)

  rows = P(batch or None, seq or None, None)
  stack_in, stack_out = P(ep or None, lat or None, hid or None), P(ep or None, hid or None,
                                                                   lat or None)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, stack_in, stack_in,
                                                   stack_out),
                       out_specs=(rows, rows))(z, idx, weights, w_g, w_u, w_d)


def _layout(mesh, num_experts: int, name: str):
  """Mesh axes of `batch`, `experts`, `latent`, `mlp`; ValueError if they cannot split."""
  batch = axes.mesh_axes("batch")
  ep, lat, hid = (axes.mesh_axes(name) for name in ("experts", "latent", "mlp"))
  if len(ep) > 1:
    raise ValueError(f"{name} dispatch: experts map to one mesh axis, got {ep}")
  ep_size = mesh.shape[ep[0]] if ep else 1
  if num_experts % ep_size:
    raise ValueError(f"{name} dispatch: mesh axis '{ep[0]}' ({ep_size} devices) does "
                     f"not divide model.moe.num_experts={num_experts}")
  seq = axes.mesh_axes("seq")
  if ep and ep[0] not in batch + seq:
    raise ValueError(f"{name} dispatch: mesh axis '{ep[0]}' splits the experts but not the "
                     f"tokens (batch -> {batch}, seq -> {seq}); each of its devices needs "
                     "its own tokens")
  if set(hid) & set(batch + seq):
    raise ValueError(f"{name} dispatch: mesh axes {hid} split both the expert hidden "
                     f"width (mlp) and the tokens; the partial sums over them need equal rows")
  return batch, ep, lat, hid


def _gather_latent(w_g, w_u, w_d, dtype, lat):
  """Local expert stacks in `dtype` with L all-gathered: [E/ep, L, H/tp], [E/ep, H/tp, L]."""
  w_g, w_u, w_d = w_g.astype(dtype), w_u.astype(dtype), w_d.astype(dtype)
  if lat:
    w_g = jax.lax.all_gather(w_g, lat, axis=1, tiled=True)
    w_u = jax.lax.all_gather(w_u, lat, axis=1, tiled=True)
    w_d = jax.lax.all_gather(w_d, lat, axis=2, tiled=True)
  return w_g, w_u, w_d


def _ragged_exchange(run, rows: jax.Array, group_sizes: jax.Array, axis: str) -> jax.Array:
  """`run` (local grouped experts) on the rows of the local experts of every peer on `axis`.
  rows: [M, L] sorted by expert; group_sizes: [E]. Peer j owns experts [j E_l, (j+1) E_l).
  Returns [M, L] in the order of `rows`."""
  ep = jax.lax.axis_size(axis)
  m, num_experts = rows.shape[0], group_sizes.shape[0]
  el = num_experts // ep
  per_peer = group_sizes.reshape(ep, el)                              # [ep, E_l] to send
  counts = jax.lax.all_to_all(per_peer, axis, 0, 0, tiled=True)       # [ep src, E_l] received
  send_sizes = per_peer.sum(1)                                        # [ep]
  recv_sizes = counts.sum(1)                                          # [ep]
  input_offsets = jnp.cumsum(send_sizes) - send_sizes                 # in rows (sorted)
  recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes                  # in the buffer
  output_offsets = jax.lax.all_to_all(recv_offsets, axis, 0, 0, tiled=True)  # at each peer
  capacity = ep * m  # the worst case: every peer sends all its pairs here
  buf = jax.lax.ragged_all_to_all(rows, jnp.zeros((capacity, rows.shape[1]), rows.dtype),
                                  input_offsets, send_sizes, output_offsets, recv_sizes,
                                  axis_name=axis)                     # [ep * M, L]
  # Regroup (source, local expert) order by local expert, the unused tail last.
  ends = jnp.cumsum(counts.reshape(-1))                               # [ep * E_l]
  segment = jnp.searchsorted(ends, jnp.arange(capacity), side="right")
  local_expert = jnp.where(segment < ep * el, segment % el, el)
  order = jnp.argsort(local_expert, stable=True)
  out_sorted = run(jnp.take(buf, order, axis=0), counts.sum(0))       # [ep * M, L]
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(capacity, dtype=order.dtype))
  out = jnp.take(out_sorted, inverse, axis=0)
  back = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)    # where rows came from
  return jax.lax.ragged_all_to_all(out, jnp.zeros_like(rows), recv_offsets, recv_sizes,
                                   back, send_sizes, axis_name=axis)


def expert_parallel_dropless_moe(z: jax.Array, idx: jax.Array, weights: jax.Array,
                                 w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act,
                                 dtype, gmm_backend: str = "auto",
                                 platform: str | None = None,
                                 token_chunk: int = 0) -> jax.Array:
  """The dropless dispatch per device with ragged all-to-alls; u [B, T, L] fp32."""
  b, t, k = idx.shape
  num_experts = w_g.shape[0]
  mesh = axes.current_mesh()
  if mesh is None:
    experts = ragged_glu_experts(w_g, w_u, w_d, act, dtype, gmm_backend, platform)
    u = dropless_moe(z.reshape(b * t, -1), idx.reshape(b * t, k), weights.reshape(b * t, k),
                     experts, num_experts, token_chunk)
    return u.reshape(b, t, -1)
  batch, ep, lat, hid = _layout(mesh, num_experts, "expert_parallel_dropless")
  seq = axes.mesh_axes("seq")

  def local(z, idx, weights, w_g, w_u, w_d):
    """One device: its rows [b_loc, t_loc, ...], its experts [E/ep, L/fsdp, H/tensor]."""
    bl, t = z.shape[:2]
    run = ragged_glu_experts(*_gather_latent(w_g, w_u, w_d, dtype, lat), act, dtype,
                             gmm_backend, platform)
    experts = ((lambda rows, sizes: _ragged_exchange(run, rows, sizes, ep[0]))
               if ep and mesh.shape[ep[0]] > 1 else run)
    z = z.reshape(bl * t, -1).astype(dtype)
    if hid:
      z = jax.lax.pcast(z, hid, to="varying")
    u = dropless_moe(z, idx.reshape(bl * t, k), weights.reshape(bl * t, k), experts,
                     num_experts, token_chunk)
    if hid:
      u = jax.lax.psum(u, hid)  # the partial sums of each tensor peer's slice of H
    return u.reshape(bl, t, -1)

  rows = P(batch or None, seq or None, None)
  stack_in, stack_out = P(ep or None, lat or None, hid or None), P(ep or None, hid or None,
                                                                   lat or None)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, stack_in, stack_in,
                                                   stack_out),
                       out_specs=rows)(z, idx, weights, w_g, w_u, w_d)

"""Expert-parallel capacity dispatch (K3_SPEC 4): the all-to-all carries the latent z.

`moe.dispatch = "expert_parallel"` is the "capacity" dispatch run per device under
`jax.shard_map` on the mesh installed by `axes.use_rules`, so its communication is
spelled out rather than left to XLA. With ep devices on the mesh axis of the `experts`
rule (`expert`), each of them:

  1. builds the buffers [E, rows_local, C, L] of its own rows from its own z (the capacity
     is per row, so this is exactly the unsharded dispatch's slice);
  2. all-to-all over `expert`: sends expert block j to peer j and receives, for its E/ep
     local experts, the buffers of all ep peers: [E/ep, ep * rows_local, C, L];
  3. runs its local experts as one batched matmul (`batched_glu_experts`);
  4. all-to-all back: [E, rows_local, C, L], and combines with its routing weights.

Only latent-wide buffers (L = moe.latent_dim) cross the all-to-all, never the hidden x
(d_model). Routing (`latent_moe.route_per_device`), histograms and load statistics
stay outside; the histograms are taken under jit on global arrays, so `aux["counts"]` is
already the sum over every data-parallel device.

Weights. The expert stacks [E, L, H] / [E, H, L] enter sharded as the rules store them
(experts -> expert, latent -> fsdp, mlp -> tensor):
  - the fsdp shards of L are all-gathered inside (in the compute dtype), so that the
    gradient leaves as a reduce-scatter over fsdp: FSDP's usual pair, no full-size
    gradient ever materialised;
  - H stays split over tensor: every tensor peer holds the same tokens and computes the
    partial output of its slice of H; the partials travel back through the all-to-all
    and are summed (psum over tensor) after the combine, on u [rows_local, T, L], which
    is k * capacity_factor times smaller than the buffers (and, in the backward, on dz).
Without a mesh the dispatch is plain `capacity_moe`, the same function on one device.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax.model import axes
from k3jax.model.moe_dispatch import batched_glu_experts, capacity_moe


def _mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def expert_parallel_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, w_g: jax.Array,
                        w_u: jax.Array, w_d: jax.Array, act, dtype, capacity: int):
  """The capacity dispatch with experts split over the mesh axis of `experts`.

  z: [B, T, L]; idx: [B, T, k] int32; weights: [B, T, k] fp32; w_g, w_u: [E, L, H];
  w_d: [E, H, L]; act: the fp32 GLU activation; capacity: pairs per expert per row.
  The mesh and the specs come from `axes.use_rules`; without it, `capacity_moe` runs on
  one device. Returns (u [B, T, L] fp32, kept [B, T, k] bool), equal to `capacity_moe`'s.
  """
  b, t, k = idx.shape
  num_experts = w_g.shape[0]
  mesh = axes.current_mesh()
  if mesh is None:
    experts = batched_glu_experts(w_g, w_u, w_d, act, dtype)
    u, kept = capacity_moe(z.reshape(b * t, -1).astype(dtype), idx.reshape(b * t, k),
                           weights.reshape(b * t, k), experts, num_experts, b, capacity)
    return u.reshape(b, t, -1), kept.reshape(b, t, k)

  batch = _mesh_axes(axes.logical_to_spec(("batch",))[0])
  ep, lat, hid = (_mesh_axes(a) for a in axes.logical_to_spec(("experts", "latent", "mlp")))
  if len(ep) > 1:
    raise ValueError(f"expert_parallel dispatch: experts map to one mesh axis, got {ep}")
  ep_size = mesh.shape[ep[0]] if ep else 1
  if num_experts % ep_size:
    raise ValueError(f"expert_parallel dispatch: mesh axis '{ep[0]}' ({ep_size} devices) does "
                     f"not divide model.moe.num_experts={num_experts}")
  if ep and ep[0] not in batch:
    raise ValueError(f"expert_parallel dispatch: mesh axis '{ep[0]}' splits the experts but "
                     f"not the batch (batch -> {batch}); each of its devices needs its own rows")
  if set(hid) & set(batch):
    raise ValueError(f"expert_parallel dispatch: mesh axes {hid} split both the expert hidden "
                     f"width (mlp) and the batch; the partial sums over them need equal rows")

  def local(z, idx, weights, w_g, w_u, w_d):
    """One device: its rows [b_loc, T, ...], its experts [E/ep, L/fsdp, H/tensor]."""
    bl = z.shape[0]
    w_g, w_u, w_d = w_g.astype(dtype), w_u.astype(dtype), w_d.astype(dtype)
    if lat:
      w_g = jax.lax.all_gather(w_g, lat, axis=1, tiled=True)  # [E/ep, L, H/tensor]
      w_u = jax.lax.all_gather(w_u, lat, axis=1, tiled=True)
      w_d = jax.lax.all_gather(w_d, lat, axis=2, tiled=True)  # [E/ep, H/tensor, L]
    run = batched_glu_experts(w_g, w_u, w_d, act, dtype)

    def experts(buf):  # [E, b_loc, C, L] -> the same, computed by the experts' owners
      if not ep:
        return run(buf)
      buf = jax.lax.all_to_all(buf, ep[0], 0, 1, tiled=True)  # [E/ep, ep * b_loc, C, L]
      return jax.lax.all_to_all(run(buf), ep[0], 1, 0, tiled=True)

    z = z.reshape(bl * t, -1).astype(dtype)
    if hid:
      # z is the same on every tensor peer; marking it varying here puts the backward's sum
      # over tensor on dz [rows_local * T, L], not on the buffers (capacity_factor * k x).
      z = jax.lax.pcast(z, hid, to="varying")
    u, kept = capacity_moe(z, idx.reshape(bl * t, k), weights.reshape(bl * t, k), experts,
                           num_experts, bl, capacity)
    if hid:
      u = jax.lax.psum(u, hid)  # the partial sums of each tensor peer's slice of H
    return u.reshape(bl, t, -1), kept.reshape(bl, t, k)

  rows = P(batch or None, None, None)  # whole sequences: capacity is per row
  stack_in, stack_out = P(ep or None, lat or None, hid or None), P(ep or None, hid or None,
                                                                   lat or None)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, stack_in, stack_in,
                                                   stack_out),
                       out_specs=(rows, rows))(z, idx, weights, w_g, w_u, w_d)

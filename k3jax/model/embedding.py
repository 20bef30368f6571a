"""The input embedding lookup with the table kept where the rules store it.

`jnp.take` of a table sharded over its width (`embed` -> fsdp) by tokens sharded over the
batch is left to XLA's partitioner, which gathers the whole table to every device and, in
the backward, scatter-adds each device's tokens into a whole fp32 [V, d] gradient before
reducing it (k3_full: fp32 [163840, 7168], 4.4 GiB per device each way). `lookup` spells
the exchange out under `jax.shard_map` on the mesh of `axes.use_rules`, with a device's
share of the table [V / vocab ways, d / embed ways] the only table it ever holds:

  1. all-gather the token ids over the mesh axes of `embed` (they split the batch rows or,
     under context parallelism, the positions too): the ids of every device that holds
     another slice of the width;
  2. look them up in the local slice (vocab split over `tensor`: rows outside the slice are
     zero and the slices are summed) -> [rows of the group, T, d / embed ways];
  3. all-to-all over the same axes: each device gets its own rows at full width.

The backward is the same in reverse: an all-to-all of the cotangent and a scatter-add into
the local slice (the sum over the other batch axes, `data` and `expert`, is the
shard_map's own reduction of a replicated input's gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import axes


def lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
  """table [V, d] (logical axes vocab, embed), tokens [B, T] int -> rows [B, T, d] in `dtype`,
  equal to `jnp.take(table, tokens, axis=0).astype(dtype)`.

  Without rules, or with rules whose `embed` axes do not all split the tokens (their batch
  rows or, under context parallelism, their positions), it is that `jnp.take`."""
  mesh = axes.current_mesh()
  if mesh is None:
    return jnp.take(table, tokens, axis=0).astype(dtype)
  vocab, embed = axes.mesh_axes("vocab"), axes.mesh_axes("embed")
  batch, seq = axes.mesh_axes("batch"), axes.mesh_axes("seq")
  if not set(embed) <= set(batch) | set(seq) or set(vocab) & (set(batch) | set(seq)):
    return jnp.take(table, tokens, axis=0).astype(dtype)
  # The width is split over `embed` in its order; its axes that split rows are gathered
  # along B, those that split positions along T.
  by_rows = tuple(a for a in embed if a in batch)
  by_pos = tuple(a for a in embed if a in seq)
  if embed != by_rows + by_pos:
    return jnp.take(table, tokens, axis=0).astype(dtype)

  def local(table, tokens):
    """table [V / vocab ways, d / embed ways]; tokens [b_loc, t_loc] -> [b_loc, t_loc, d]."""
    if by_rows:
      tokens = jax.lax.all_gather(tokens, by_rows, axis=0, tiled=True)
    if by_pos:
      tokens = jax.lax.all_gather(tokens, by_pos, axis=1, tiled=True)  # [group rows, T, ...]
    if vocab:
      v_loc = table.shape[0]
      ids = tokens - jax.lax.axis_index(vocab) * v_loc
      inside = (ids >= 0) & (ids < v_loc)
      rows = jnp.take(table, jnp.clip(ids, 0, v_loc - 1), axis=0)
      rows = jax.lax.psum(jnp.where(inside[..., None], rows, 0).astype(dtype), vocab)
    else:
      rows = jnp.take(table, tokens, axis=0).astype(dtype)             # [rows, T, d_loc]
    # Back to this device's tokens at full width: the minor width axes first.
    if by_pos:
      rows = jax.lax.all_to_all(rows, by_pos, 1, 2, tiled=True)
    if by_rows:
      rows = jax.lax.all_to_all(rows, by_rows, 0, 2, tiled=True)       # [b_loc, t_loc, d]
    return rows

  rows_spec = P(batch or None, seq or None)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(vocab or None, embed or None), rows_spec),
                       out_specs=P(batch or None, seq or None, None))(table, tokens)

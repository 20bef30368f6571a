"""The input embedding lookup under `jax.shard_map`, each device holding only its table slice.

XLA would gather the whole table (and its fp32 gradient) to every device; `lookup`
all-gathers the ids over `embed`'s axes, looks up locally and all-to-alls back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import axes


def lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
  """table [V, d], tokens [B, T] -> rows [B, T, d] in `dtype`, as `jnp.take`."""
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

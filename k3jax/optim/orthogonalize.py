"""Newton-Schulz over the blocks of many parameters at once (Muon's step): blocks of one
shape are concatenated and orthogonalized in one call a group, and on a mesh each device
takes 1/G of a group's blocks whole, regrouped by an all-to-all over the mesh axes that
split the blocks' fan dimensions."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from k3jax.axes import spec_axes


def orthogonalize_all(blocks: list[jax.Array], ns, *, mesh: Mesh | None = None,
                      specs: list[PartitionSpec] | None = None,
                      group_bytes: int = 0) -> list[jax.Array]:
  """`ns` of every block of every array in `blocks` ([*batch, fan_in, fan_out] each), same-shaped
  blocks batched together in groups of at most group_bytes a device (0: an array a call), so
  a step launches one Newton-Schulz per group, not one per parameter. mesh, specs: the arrays'
  shardings (`BlockLayout.block_spec`); then it runs under `shard_map`, each device's blocks
  regrouped by an all-to-all so it orthogonalizes 1/G of them whole."""
  if mesh is None or specs is None:
    return _orthogonalize_local(blocks, [((), ())] * len(blocks), ns, None, group_bytes)
  fan_axes = [tuple(tuple(spec_axes(e)) for e in tuple(spec)[-2:]) for spec in specs]

  def local(*xs):
    return tuple(_orthogonalize_local(list(xs), fan_axes, ns, mesh, group_bytes))

  # A Pallas kernel in a partitioned program must sit in a shard_map.
  return list(jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(specs),
                            check_vma=False)(*blocks))


def _orthogonalize_local(xs, fan_axes, ns, mesh, group_bytes):
  """`orthogonalize_all` of this device's pieces: xs[i]'s fan dims split over fan_axes[i]."""
  keys = [(x.shape[-2:], x.dtype, axes) for x, axes in zip(xs, fan_axes)]
  out = [None] * len(xs)
  for group in block_groups(keys, [x.size * x.dtype.itemsize for x in xs], group_bytes):
    ys = _orthogonalize_group([xs[i] for i in group], fan_axes[group[0]], ns, mesh)
    for i, y in zip(group, ys):
      out[i] = y
  return out


def block_groups(keys: list, sizes: list[int], cap: int) -> list[list[int]]:
  """Indices of equal keys grouped in order, each group's sizes summing to at most cap (an
  item larger than cap alone); cap 0: an item a group."""
  groups, open_ = [], {}
  for i, (key, size) in enumerate(zip(keys, sizes)):
    g = open_.get(key)
    if g is None or g[1] + size > cap:
      g = open_[key] = [[], 0]
      groups.append(g[0])
    g[0].append(i)
    g[1] += size
  return groups


def _orthogonalize_group(xs, fan_axes, ns, mesh):
  """One `ns` over the pieces xs (equal [fan_in, fan_out] pieces, split over fan_axes)."""
  leads = [x.shape[:-2] for x in xs]
  counts = [math.prod(lead) for lead in leads]
  x = jnp.concatenate([x.reshape(n, *x.shape[-2:]) for x, n in zip(xs, counts)])
  n = x.shape[0]
  if any(fan_axes):  # all-to-all: each device takes 1/G of the blocks whole
    ways = [math.prod(mesh.shape[a] for a in axes) for axes in fan_axes]
    x = jnp.pad(x, ((0, -n % (ways[0] * ways[1])), (0, 0), (0, 0)))
    for dim, axes in ((1, fan_axes[0]), (2, fan_axes[1])):
      if axes:
        x = jax.lax.all_to_all(x, axes, 0, dim, tiled=True)
  y = ns(x)
  if any(fan_axes):
    for dim, axes in ((2, fan_axes[1]), (1, fan_axes[0])):
      if axes:
        y = jax.lax.all_to_all(y, axes, dim, 0, tiled=True)
  starts = itertools.accumulate(counts, initial=0)
  return [y[s:s + c].reshape(*lead, *y.shape[-2:]) for s, c, lead in zip(starts, counts, leads)]

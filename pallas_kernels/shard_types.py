"""Mesh axes as the dispatchers take them, and custom-VJP cotangents typed for `shard_map`."""

import math

import jax


def axis_names(*axes) -> tuple[str, ...]:
  """The mesh axis names in `axes` (each None, a name or a tuple of names), in order."""
  return tuple(n for a in axes if a is not None for n in ((a,) if isinstance(a, str) else a))


def axis_size(mesh, *axes) -> int:
  """How many devices of `mesh` the axes span together."""
  return math.prod(mesh.shape[a] for a in axis_names(*axes))


def varying(x: jax.Array) -> frozenset:
  """The shard_map mesh axes x varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())


def cotangent_like(ct: jax.Array, x: jax.Array) -> jax.Array:
  """ct typed like its primal x under shard_map: psum over the axes only ct varies over (x
  was broadcast there), pcast to varying where only x varies, as JAX's autodiff does."""
  extra, missing = varying(ct) - varying(x), varying(x) - varying(ct)
  if extra:
    ct = jax.lax.psum(ct, tuple(sorted(extra)))
  if missing:
    ct = jax.lax.pcast(ct, tuple(sorted(missing)), to="varying")
  return ct

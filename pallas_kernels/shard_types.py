"""Cotangents of custom VJPs under `shard_map`, typed like their primals."""

import jax


def varying(x: jax.Array) -> frozenset:
  """The shard_map mesh axes x varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older: `vma`
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())


def cotangent_like(ct: jax.Array, x: jax.Array) -> jax.Array:
  """A custom VJP's cotangent ct given the type of its primal x under shard_map: summed over
  the axes only ct varies over (x was used there as if broadcast), marked varying where x
  is. JAX's own autodiff inserts the same psum / pcast."""
  extra, missing = varying(ct) - varying(x), varying(x) - varying(ct)
  if extra:
    ct = jax.lax.psum(ct, tuple(sorted(extra)))
  if missing:
    ct = jax.lax.pcast(ct, tuple(sorted(missing)), to="varying")
  return ct

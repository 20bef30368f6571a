"""What optimizers read from a parameter's metadata (set by `k3jax.model.layers.param`)."""

from __future__ import annotations

from flax import nnx

STACKED_AXES = ("layers",)   # logical axis names that stack layers, not matrix dims


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def axis_names(var: nnx.Variable) -> tuple | None:
  """The logical axis names of `var` (stacked axes included), or None if it has none."""
  meta = var.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if isinstance(names, (tuple, list)):
      return tuple(names)
  return None

"""Logical axis names and `constrain`: the contract the model, the optimizer and
`k3jax.parallel` share. Only the rules installed by `use_rules` map them to mesh axes.

  batch      sequences in a batch            seq        positions in a sequence
  kv_seq     positions of attention keys (never split: each device sees all of its rows')
  embed      model width d                   vocab      vocabulary
  heads      attention heads                 head_dim   per-head q/k/v width
  q_lora     MLA query low rank              kv_lora    MLA key/value low rank
  mlp        FFN intermediate width          experts    routed experts
  latent     LatentMoE latent width          gate_rank  KDA low-rank decay width
  conv       short-conv taps                 layers     stacked (scanned) layers
  sources    AttnRes sources                 cache_seq  a decoding cache's positions"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AxisNames = tuple[str | None, ...]
STACKED_AXES = ("layers",)   # names a scan stacks layers on: never a matrix or batch dim


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def axis_names(var: nnx.Variable) -> AxisNames:
  """The logical axis names of a variable (stacked axes included), None where unnamed."""
  meta = var.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if isinstance(names, (tuple, list)):
      return tuple(names)
  return (None,) * len(var.shape)


class _Rules(threading.local):
  mesh: Mesh | None = None
  rules: dict[str, str | tuple[str, ...] | None] = {}


_ctx = _Rules()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Sequence[tuple[str, str | tuple[str, ...] | None]]):
  """Within the block, `constrain` maps logical names to `mesh` axes by `rules`."""
  old = (_ctx.mesh, _ctx.rules)
  _ctx.mesh, _ctx.rules = mesh, dict(rules)
  try:
    yield
  finally:
    _ctx.mesh, _ctx.rules = old


@contextlib.contextmanager
def unsplit(*names: str):
  """Within the block, the installed rules split none of the logical axes `names`."""
  if _ctx.mesh is None:
    yield
    return
  with use_rules(_ctx.mesh, {**_ctx.rules, **dict.fromkeys(names)}.items()):
    yield


def current_mesh() -> Mesh | None:
  """The mesh installed by `use_rules`, or None outside it."""
  return _ctx.mesh


def logical_to_spec(names: AxisNames, rules=None) -> PartitionSpec:
  """PartitionSpec for logical `names`; each mesh axis is used at most once."""
  rules = _ctx.rules if rules is None else dict(rules)
  used: set[str] = set()
  spec = []
  for name in names:
    target = rules.get(name) if name is not None else None
    axes = tuple(a for a in spec_axes(target) if a not in used)
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*spec)


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def mesh_axes(name: str, rules=None) -> tuple[str, ...]:
  """The mesh axes the rules map logical axis `name` to."""
  return spec_axes(logical_to_spec((name,), rules)[0])


def split_ways(name: str) -> int:
  """Into how many parts the installed mesh splits the logical axis `name` (1 without one)."""
  if _ctx.mesh is None:
    return 1
  return math.prod(_ctx.mesh.shape[a] for a in mesh_axes(name))


def split_axes(name: str) -> str | tuple[str, ...] | None:
  """The PartitionSpec entry `name` splits over on the installed mesh, or None if unsplit."""
  if split_ways(name) == 1:
    return None
  return logical_to_spec((name,))[0]


def constrain_each(values: dict, names: dict[str, AxisNames], stacked: int = 0) -> dict:
  """`constrain` each array of a dict by its key's names, after `stacked` leading axes."""
  return {key: constrain(x, (None,) * stacked + names[key]) for key, x in values.items()}


def constrain(x: jax.Array, names: AxisNames) -> jax.Array:
  """Sharding constraint on an activation by logical names; a no-op without rules."""
  if _ctx.mesh is None:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {names} for an array of shape {x.shape}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(_ctx.mesh, logical_to_spec(names)))

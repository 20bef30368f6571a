"""Logical-axis rules and the shardings of parameters, optimizer state and batches.

The model names axes (`k3jax.axes`); RULES map them to mesh axes. A mesh axis is
used once per array (first come, first served), so an activation [batch, seq, embed]
puts fsdp on `batch` while a weight [embed, mlp] puts it on `embed`."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.axes import axis_names, is_variable, logical_to_spec, spec_axes
from k3jax.config_error import ConfigError
from k3jax.parallel.config import EXPERT_SPLITS

def rules(expert_splits: str = "batch") -> tuple:
  """The logical-axis rules; `expert_splits`: the token dim `expert` splits outside the MoE."""
  if expert_splits not in EXPERT_SPLITS:
    raise ConfigError(f"config.mesh.expert_splits: must be one of {EXPERT_SPLITS}, "
                      f"got {expert_splits!r}")
  tokens = ((("batch", ("data", "fsdp", "expert")), ("seq", "context"))
            if expert_splits == "batch" else
            (("batch", ("data", "fsdp")), ("seq", ("expert", "context"))))
  return (
      *tokens,
      ("cache_seq", tokens[1][1]),   # a decoding cache's positions, as a sequence's
      # weights: FSDP over every axis that splits tokens, so none holds copies
      ("embed", ("fsdp", "expert", "context")),
      ("latent", ("fsdp", "context")),  # routed-expert stacks (split over expert by `experts`)
      ("heads", "tensor"),
      ("mlp", "tensor"),
      ("vocab", "tensor"),
      ("experts", "expert"),
  )


RULES = rules()


def param_specs(state: Any, rules=RULES) -> Any:
  """A PartitionSpec per leaf of `nnx.as_pure(state)` from its logical axis names."""
  return jax.tree.map(lambda v: logical_to_spec(axis_names(v), rules), state,
                      is_leaf=is_variable)


def check_divisible(state: Any, mesh: Mesh, rules=RULES) -> None:
  """ConfigError naming the first parameter dimension its mesh axes do not divide."""
  for path, var in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=is_variable):
    spec = logical_to_spec(axis_names(var), rules)
    for dim, (size, entry, name) in enumerate(zip(var.shape, spec, axis_names(var))):
      axes = spec_axes(entry)
      ways = 1
      for a in axes:
        ways *= mesh.shape[a]
      if size % ways:
        raise ConfigError(
            f"config.mesh: {jax.tree_util.keystr(path)} has {size} along '{name}' (dim {dim}), "
            f"which does not split over mesh axes {axes} of size {ways}")


def state_shardings(mesh: Mesh, tx: optax.GradientTransformation, abs_vars: Any,
                    rules=RULES) -> tuple[Any, Any]:
  """NamedShardings of (params, opt_state); moments like the parameters, counts replicated."""
  params = shardings(mesh, abs_vars, rules)
  abs_opt = jax.eval_shape(tx.init, nnx.as_pure(abs_vars))
  replicated = NamedSharding(mesh, PartitionSpec())
  masked = optax.MaskedNode
  opt = optax.tree_map_params(
      tx, lambda p, s: p if isinstance(p, masked) else s, abs_opt, params,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, (NamedSharding, masked)))
  return params, opt


def shardings(mesh: Mesh, state: Any, rules=RULES) -> Any:
  """A NamedSharding per leaf of `nnx.as_pure(state)` (any Variable state)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(state, rules),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec(rules=RULES) -> PartitionSpec:
  """The sharding of [batch, seq] arrays."""
  return logical_to_spec(("batch", "seq"), rules)

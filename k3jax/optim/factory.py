"""The optimizer an experiment names: gradient clipping + a registered update rule.

  tx, schedule = make_optimizer(cfg, decay_mask=weight_decay_mask(nnx.state(model, nnx.Param)))

The transformation acts on the `nnx.Param` state only (the model's other state, e.g. the
MoE balancing bias, is updated outside the gradient). It works both with
`nnx.Optimizer(model, tx, wrt=nnx.Param)` and with a functional step over
`nnx.as_pure(nnx.state(model, nnx.Param))`.

Weight decay (decoupled, AdamW-style: p <- p - lr * (adam_update + wd * p)) applies to
matrices only. A parameter is decayed when it has at least two dims that are not stacked
layer axes (logical name "layers"): projections, expert weights [experts, in, out], the
input embedding and the LM head. Norm gains, biases, AttnRes pseudo-queries, A_log,
dt_bias and every other 1-D (per layer) parameter are not. A Param created with the
metadata `weight_decay=False` (or True) overrides the rule, e.g. for a query table stored
as one [sublayers, d] matrix.

Without `decay_mask` the rule is applied by `ndim` of the raw arrays, which is right only
when no parameter is stacked over layers; a scanned model must pass
`weight_decay_mask(nnx.state(model, nnx.Param))` (it reads the logical axis names).

New update rules (per-head Muon, K3_SPEC 5) register a builder in `OPTIMIZERS`:
`builder(cfg, schedule, decay_mask) -> optax.GradientTransformation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx

from k3jax.optim.schedule import warmup_cosine

STACKED_AXES = ("layers",)   # logical axis names that stack layers, not matrix dims

DecayMask = Any   # a pytree of bools, or a callable params -> pytree of bools
Builder = Callable[[ml_collections.ConfigDict, optax.Schedule, DecayMask],
                   optax.GradientTransformation]


def _axis_names(var: nnx.Variable) -> tuple | None:
  meta = var.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if isinstance(names, (tuple, list)):
      return tuple(names)
  return None


def _decay_variable(var: nnx.Variable) -> bool:
  meta = var.get_metadata()
  if "weight_decay" in meta:
    return bool(meta["weight_decay"])
  names = _axis_names(var)
  ndim = len(var.shape)
  if names is not None and len(names) == ndim:
    ndim -= sum(1 for n in names if n in STACKED_AXES)
  return ndim >= 2


def weight_decay_mask(params: Any) -> Any:
  """True where weight decay applies, for a parameter state (see the module docstring).

  `params` is `nnx.state(model, nnx.Param)` (Variables with their axis-name metadata;
  concrete or from `nnx.eval_shape`) or a pytree of arrays (decided by ndim). The result
  has the structure of the pure state `nnx.as_pure(params)`, with bool leaves.
  """
  def leaf(x):
    if isinstance(x, nnx.Variable):
      return _decay_variable(x)
    return len(x.shape) >= 2

  return jax.tree.map(leaf, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def ndim_decay_mask(params: Any) -> Any:
  """Decay every leaf with ndim >= 2 (for unstacked parameter trees)."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def _adamw(cfg: ml_collections.ConfigDict, schedule: optax.Schedule,
           decay_mask: DecayMask) -> optax.GradientTransformation:
  o = cfg.optimizer
  return optax.adamw(learning_rate=schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                     weight_decay=o.weight_decay, mask=decay_mask)


OPTIMIZERS: dict[str, Builder] = {
    "adamw": _adamw,
}


def make_schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
  """The learning-rate schedule of `cfg.optimizer` over `cfg.train.steps`."""
  o = cfg.optimizer
  return warmup_cosine(o.learning_rate, o.warmup_steps, cfg.train.steps, o.min_lr_ratio)


def make_optimizer(cfg: ml_collections.ConfigDict, *, decay_mask: DecayMask | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule) for `cfg.optimizer` and `cfg.train`.

  The transformation clips the global gradient norm to `cfg.train.grad_clip_norm`
  (0 disables clipping), then applies the update rule `cfg.optimizer.name` with the
  learning rate `schedule(count)`. `decay_mask`: see the module docstring.
  """
  name = cfg.optimizer.name
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name: unknown optimizer {name!r} "
                     f"(known: {', '.join(sorted(OPTIMIZERS))})")
  schedule = make_schedule(cfg)
  mask = ndim_decay_mask if decay_mask is None else decay_mask
  rule = OPTIMIZERS[name](cfg, schedule, mask)
  clip = cfg.train.grad_clip_norm
  if clip < 0:
    raise ValueError(f"config.train.grad_clip_norm: must be >= 0, got {clip}")
  if clip > 0:
    rule = optax.chain(optax.clip_by_global_norm(clip), rule)
  return rule, schedule

"""The optimizer an experiment names: gradient clipping + a registered update rule.

  tx, schedule = make_optimizer(cfg, nnx.state(model, nnx.Param))

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

Given the parameter state, the mask reads the logical axis names (`weight_decay_mask`);
given only raw arrays, it goes by `ndim`, which is right only when no parameter is
stacked over layers.

Update rules register a builder in `OPTIMIZERS`:
`builder(cfg, schedule, params, decay_mask, *, mesh, param_specs) -> GradientTransformation`,
where `params` is the parameter state with the model's metadata (or None when the caller
has only raw arrays; rules that read metadata, like Muon, then refuse).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx

from k3jax.optim import muon as muon_lib
from k3jax.axes import STACKED_AXES, axis_names, is_variable
from k3jax.optim.schedule import ScheduleParams, scheduled, warmup_cosine

DecayMask = Any   # a pytree of bools, or a callable params -> pytree of bools
Builder = Callable[[ml_collections.ConfigDict, optax.Schedule, Any, DecayMask],
                   optax.GradientTransformation]


def _decay_variable(var: nnx.Variable) -> bool:
  meta = var.get_metadata()
  if "weight_decay" in meta:
    return bool(meta["weight_decay"])
  names = axis_names(var)
  ndim = len(var.shape)
  if len(names) == ndim:
    ndim -= sum(1 for n in names if n in STACKED_AXES)
  return ndim >= 2


def weight_decay_mask(params: Any) -> Any:
  """True where weight decay applies, for a parameter state (see the module docstring).

  `params` is `nnx.state(model, nnx.Param)` (Variables with their axis-name metadata;
  concrete or from `nnx.eval_shape`) or a pytree of arrays (decided by ndim). The result
  has the structure of the pure state `nnx.as_pure(params)`, with bool leaves.
  """
  def leaf(x):
    if is_variable(x):
      return _decay_variable(x)
    return len(x.shape) >= 2

  return jax.tree.map(leaf, params, is_leaf=is_variable)


def ndim_decay_mask(params: Any) -> Any:
  """Decay every leaf with ndim >= 2 (for unstacked parameter trees)."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def _adamw(cfg: ml_collections.ConfigDict, schedule: optax.Schedule, params: Any,
           decay_mask: DecayMask, **placement) -> optax.GradientTransformation:
  del params, placement  # elementwise: runs sharded as it is
  o = cfg.optimizer
  return optax.adamw(learning_rate=schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                     weight_decay=o.weight_decay, mask=decay_mask)


def _muon(cfg: ml_collections.ConfigDict, schedule: optax.Schedule, params: Any,
          decay_mask: DecayMask, **placement) -> optax.GradientTransformation:
  if params is None:
    raise ValueError("optimizer 'muon' reads each parameter's block layout from the model's "
                     "metadata: pass make_optimizer(cfg, nnx.state(model, nnx.Param))")
  if callable(decay_mask):
    decay_mask = decay_mask(nnx.as_pure(params))
  return muon_lib.muon(cfg, schedule, params, decay_mask, **placement)


OPTIMIZERS: dict[str, Builder] = {
    "adamw": _adamw,
    "muon": _muon,
}


def make_schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
  """The learning-rate schedule of `cfg.optimizer` over `cfg.train.steps`."""
  o = cfg.optimizer
  return warmup_cosine(o.learning_rate, o.warmup_steps, cfg.train.steps, o.min_lr_ratio)


def make_optimizer(cfg: ml_collections.ConfigDict, params: Any = None, *,
                   decay_mask: DecayMask | None = None, mesh: Any = None,
                   param_specs: Any = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule) for `cfg.optimizer` and `cfg.train`.

  The transformation clips the global gradient norm to `cfg.train.grad_clip_norm`
  (0 disables clipping), then applies the update rule `cfg.optimizer.name` with the
  learning rate `schedule(count)`, whose numbers live in the state (`schedule.scheduled`:
  `optim.with_schedule` sets them for another config without recompiling).

  params: `nnx.state(model, nnx.Param)` (abstract is enough): the rules read block layouts
    and the weight-decay mask from its metadata. The transformation then acts on
    `nnx.as_pure(params)`-shaped trees.
  decay_mask: overrides the mask; without params or mask, leaves with ndim >= 2 decay.
  mesh, param_specs: where sharded parameters live (a PartitionSpec per leaf of the pure
    state), for rules that must place work per device (Muon's Newton-Schulz kernel).
  """
  name = cfg.optimizer.name
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name: unknown optimizer {name!r} "
                     f"(known: {', '.join(sorted(OPTIMIZERS))})")
  if decay_mask is None:
    decay_mask = ndim_decay_mask if params is None else nnx.as_pure(weight_decay_mask(params))
  clip = cfg.train.grad_clip_norm
  if clip < 0:
    raise ValueError(f"config.train.grad_clip_norm: must be >= 0, got {clip}")

  def build(schedule):
    rule = OPTIMIZERS[name](cfg, schedule, params, decay_mask, mesh=mesh,
                            param_specs=param_specs)
    return optax.chain(optax.clip_by_global_norm(clip), rule) if clip > 0 else rule

  schedule = make_schedule(cfg)   # checks the numbers
  build(schedule)                  # and the rule its arguments, now rather than at init
  return scheduled(build, ScheduleParams.of(cfg)), schedule


def describe(cfg: ml_collections.ConfigDict, params: Any) -> str:
  """One start-up log line: which update rule gets how many parameters."""
  o = cfg.optimizer
  sizes = jax.tree.map(lambda v: math.prod(v.shape), params, is_leaf=is_variable)
  clip = f"; QK-Clip tau {o.qk_clip_tau:g}" if o.qk_clip_tau > 0 else "; QK-Clip off"
  if o.name != "muon":
    return f"{o.name} on {sum(jax.tree.leaves(sizes)):,} parameters{clip}"
  labels = muon_lib.muon_labels(params, router=o.muon.router)
  count = {"muon": [0, 0], "adamw": [0, 0]}
  for label, size in zip(jax.tree.leaves(labels), jax.tree.leaves(sizes)):
    count[label][0] += size
    count[label][1] += 1
  u = o.muon
  return (f"muon ({'per-head' if u.per_head else 'whole-matrix'}, NS{u.ns_steps} in "
          f"{u.ns_dtype} via {u.ns_backend!r}, router {u.router}) on {count['muon'][0]:,} "
          f"parameters in {count['muon'][1]} arrays; adamw on {count['adamw'][0]:,} in "
          f"{count['adamw'][1]}{clip}")

"""The optimizer an experiment names: gradient clipping + a rule registered in `OPTIMIZERS`.

  tx, schedule = make_optimizer(cfg, nnx.state(model, nnx.Param))

Weight decay applies to parameters with two or more non-"layers" axes (metadata
`weight_decay=` overrides)."""

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
  """Bools like `nnx.as_pure(params)`: True where weight decay applies."""
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
  Clips to `cfg.train.grad_clip_norm` (0: off), then applies `cfg.optimizer.name`; the
  schedule's numbers live in the state (`optim.with_schedule`). params: its metadata gives
  layouts and the decay mask; mesh, param_specs: for per-device work (Muon)."""
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

  schedule = make_schedule(cfg)
  build(schedule)
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

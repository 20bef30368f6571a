"""Learning-rate schedules: step -> learning rate, traceable under jit.

The numbers live in the optimizer state (`scheduled`), so changing them reuses the
compiled step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


def warmup_cosine(peak, warmup_steps, total_steps, min_ratio) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, then cosine decay to `peak * min_ratio`.
    lr(s) = peak * s / warmup                                     for s < warmup
    lr(s) = peak * (r + (1 - r) * (1 + cos(pi * p)) / 2),         otherwise,
            p = clip((s - warmup) / (total - warmup), 0, 1),  r = min_ratio

  `step` is optax's count (the first update uses lr(0)); arguments may be traced."""
  if isinstance(warmup_steps, int) and isinstance(total_steps, int) and (
      warmup_steps < 0 or total_steps < warmup_steps):
    raise ValueError(f"warmup_cosine: need 0 <= warmup_steps={warmup_steps} "
                     f"<= total_steps={total_steps}")
  warmup = jnp.asarray(warmup_steps, jnp.float32)
  decay = jnp.maximum(jnp.asarray(total_steps, jnp.float32) - warmup, 1.0)

  def schedule(step):
    s = jnp.asarray(step, jnp.float32)
    frac = jnp.clip((s - warmup) / decay, 0.0, 1.0)
    cosine = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
    ramp = s / jnp.maximum(warmup, 1.0)
    return peak * jnp.where(s < warmup, ramp, cosine)

  return schedule


class ScheduleParams(NamedTuple):
  """warmup_cosine's numbers as fp32 scalars (state of `scheduled`)."""
  peak: Any
  warmup_steps: Any
  total_steps: Any
  min_ratio: Any

  @classmethod
  def of(cls, cfg) -> ScheduleParams:
    """From `cfg.optimizer` (learning_rate, warmup_steps, min_lr_ratio) and `cfg.train.steps`."""
    o = cfg.optimizer
    return cls(*(jnp.asarray(x, jnp.float32) for x in
                 (o.learning_rate, o.warmup_steps, cfg.train.steps, o.min_lr_ratio)))

  def schedule(self) -> optax.Schedule:
    return warmup_cosine(*self)


class ScheduledState(NamedTuple):
  schedule: ScheduleParams
  inner: Any


def scheduled(build: Callable[[optax.Schedule], optax.GradientTransformation],
              params: ScheduleParams) -> optax.GradientTransformation:
  """`build(schedule)` with the schedule's numbers `params` kept in the state."""
  def init(p):
    return ScheduledState(params, build(params.schedule()).init(p))

  def update(grads, state, p=None):
    updates, inner = build(state.schedule.schedule()).update(grads, state.inner, p)
    return updates, ScheduledState(state.schedule, inner)

  return optax.GradientTransformation(init, update)


def with_schedule(opt_state: ScheduledState, params: ScheduleParams) -> ScheduledState:
  """opt_state with its schedule's numbers replaced, placed alike."""
  new = [jax.device_put(x, getattr(old, "sharding", None))
         for x, old in zip(params, opt_state.schedule)]
  return opt_state._replace(schedule=ScheduleParams(*new))

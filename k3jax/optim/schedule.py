"""Learning-rate schedules: step -> learning rate, traceable under jit."""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int,
                  min_ratio: float) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, then cosine decay to `peak * min_ratio`.

    lr(s) = peak * s / warmup                                     for s < warmup
    lr(s) = peak * (r + (1 - r) * (1 + cos(pi * p)) / 2),         otherwise,
            p = clip((s - warmup) / (total - warmup), 0, 1),  r = min_ratio

  so lr(0) = 0 (with warmup), lr(warmup) = peak, lr(total) = peak * min_ratio, and the
  rate stays at peak * min_ratio after `total_steps`. `step` is the number of updates
  already applied (optax's count), so the first update uses lr(0).
  """
  if warmup_steps < 0 or total_steps < warmup_steps:
    raise ValueError(f"warmup_cosine: need 0 <= warmup_steps={warmup_steps} "
                     f"<= total_steps={total_steps}")
  warmup = float(warmup_steps)
  decay = float(max(total_steps - warmup_steps, 1))

  def schedule(step):
    s = jnp.asarray(step, jnp.float32)
    frac = jnp.clip((s - warmup) / decay, 0.0, 1.0)
    cosine = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
    ramp = s / max(warmup, 1.0)
    return peak * jnp.where(s < warmup, ramp, cosine)

  return schedule

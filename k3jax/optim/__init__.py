"""Optimizers and learning-rate schedules."""

from k3jax.optim.factory import (
    OPTIMIZERS,
    STACKED_AXES,
    make_optimizer,
    make_schedule,
    ndim_decay_mask,
    weight_decay_mask,
)
from k3jax.optim.schedule import warmup_cosine

__all__ = [
    "OPTIMIZERS",
    "STACKED_AXES",
    "make_optimizer",
    "make_schedule",
    "ndim_decay_mask",
    "warmup_cosine",
    "weight_decay_mask",
]

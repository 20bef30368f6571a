"""Optimizers and learning-rate schedules."""

from k3jax.axes import STACKED_AXES
from k3jax.optim.factory import (
    OPTIMIZERS,
    describe,
    make_optimizer,
    make_schedule,
    ndim_decay_mask,
    weight_decay_mask,
)
from k3jax.optim.muon import BlockLayout, block_layouts, muon_labels, scale_by_muon
from k3jax.optim.schedule import ScheduleParams, warmup_cosine, with_schedule

__all__ = [
    "OPTIMIZERS",
    "ScheduleParams",
    "STACKED_AXES",
    "BlockLayout",
    "block_layouts",
    "describe",
    "make_optimizer",
    "make_schedule",
    "muon_labels",
    "ndim_decay_mask",
    "scale_by_muon",
    "warmup_cosine",
    "weight_decay_mask",
    "with_schedule",
]

"""The device mesh of a run, from `config.mesh` (axis sizes; -1 = what the others leave).

  data    pure data parallelism (parameters replicated across it)
  fsdp    data parallelism with parameters and optimizer state sharded across it
  expert  data parallelism for the dense parts, routed experts split across it
  tensor  heads and FFN widths split across it (within a layer)

Batches are split over data x fsdp x expert; the rules in `sharding.py` say which
logical axis of which array goes where.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import ml_collections
from jax.sharding import Mesh

from k3jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def mesh_shape(cfg_mesh: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Axis sizes with -1 resolved; ConfigError naming the field if they cannot tile the devices."""
  sizes = {a: int(cfg_mesh[a]) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  for a, s in sizes.items():
    if s < 1 and s != -1:
      raise ConfigError(f"config.mesh.{a}: must be >= 1 or -1 (fill), got {s}")
  if len(free) > 1:
    raise ConfigError(f"config.mesh: only one axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise ConfigError(f"config.mesh: the fixed axes ({fixed} devices) do not divide the "
                        f"{num_devices} devices, so mesh.{free[0]}=-1 cannot fill them")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f"config.mesh: {sizes} needs {fixed} devices, but there are {num_devices}")
  return sizes


def make_mesh(cfg_mesh: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh over `devices` (default: all), axes MESH_AXES, every axis in Auto mode."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(cfg_mesh, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))

"""The device mesh of a run, from `config.mesh` (axis sizes; -1 = what the others leave).

Axes: data (replicated), fsdp (state sharded), expert (routed experts split), context
(positions split; weights as fsdp), tensor (heads, FFN widths). Rules: sharding.py; axes
further right get closer devices. Across slices (DCN), `mesh.dcn_<axis>` of each axis's
ways span slices (multiplying to their number), the slice being the outer index; slices
are `slice_index` (TPU) or processes."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from k3jax.config_error import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


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


def dcn_shape(cfg_mesh: ml_collections.ConfigDict, sizes: dict[str, int],
              num_slices: int) -> dict[str, int]:
  """The DCN part of each axis; ConfigError naming the field if inconsistent."""
  dcn = {a: int(cfg_mesh[f"dcn_{a}"]) for a in MESH_AXES}
  for a, s in dcn.items():
    if s < 1:
      raise ConfigError(f"config.mesh.dcn_{a}: must be >= 1, got {s}")
    if sizes[a] % s:
      raise ConfigError(f"config.mesh.dcn_{a}: {s} slices do not divide mesh.{a} = "
                        f"{sizes[a]} (the ICI part mesh.{a} / dcn_{a} must be whole)")
  if math.prod(dcn.values()) != num_slices:
    across = {f"dcn_{a}": s for a, s in dcn.items() if s > 1} or "all 1"
    hint = (f"e.g. mesh.dcn_data={num_slices}" if num_slices > 1 else
            "on one slice every mesh.dcn_* is 1")
    raise ConfigError(
        f"config.mesh.dcn_*: the devices form {num_slices} slice(s), but the DCN sizes "
        f"({across}) multiply to {math.prod(dcn.values())}; they must multiply to the number "
        f"of slices ({hint})")
  return dcn


def slices(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
  """The devices grouped by slice, in slice order."""
  def key(d):
    if hasattr(d, "slice_index"):
      return d.slice_index
    return 0 if d.platform == "tpu" else d.process_index
  groups = collections.defaultdict(list)
  for d in devices:
    groups[key(d)].append(d)
  return [groups[k] for k in sorted(groups)]


def make_mesh(cfg_mesh: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh (axes MESH_AXES, Auto mode) over `devices` (default: all), hybrid over slices."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(cfg_mesh, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  groups = slices(devices)
  across = math.prod(int(cfg_mesh[f"dcn_{a}"]) for a in MESH_AXES)
  if len(groups) == 1 or (devices[0].platform != "tpu" and across == 1):
    # One slice (or GPU/CPU processes without a DCN split asked for): one ICI mesh.
    dcn_shape(cfg_mesh, sizes, 1)
    with _named_layout_error(sizes, groups[0]):
      if cfg_mesh.split_physical_axes and devices[0].platform == "tpu":
        array = mesh_utils.create_device_mesh(tuple(sizes[a] for a in MESH_AXES), devices,
                                              allow_split_physical_axes=True)
        return Mesh(array, MESH_AXES, axis_types=axis_types)
      return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                           axis_types=axis_types)
  dcn = dcn_shape(cfg_mesh, sizes, len(groups))
  per_slice = {len(g) for g in groups}
  if len(per_slice) > 1:
    raise ConfigError(f"config.mesh.dcn_*: the slices have different device counts "
                      f"{sorted(per_slice)}; a hybrid mesh needs equal slices")
  ici = tuple(sizes[a] // dcn[a] for a in MESH_AXES)
  with _named_layout_error(dict(zip(MESH_AXES, ici)), groups[0]):
    array = mesh_utils.create_hybrid_device_mesh(
        ici, tuple(dcn[a] for a in MESH_AXES), devices,
        process_is_granule=not hasattr(devices[0], "slice_index"),
        allow_split_physical_axes=(cfg_mesh.split_physical_axes
                                   or devices[0].device_kind in ("TPU v5 lite", "TPU v5e")))
  return Mesh(np.asarray(array), MESH_AXES, axis_types=axis_types)


@contextlib.contextmanager
def _named_layout_error(ici: dict[str, int], slice_devices: Sequence[jax.Device]):
  """ConfigError when the per-slice axes cannot be laid onto the physical torus."""
  try:
    yield
  except (NotImplementedError, ValueError) as e:
    coords = [d.coords for d in slice_devices if hasattr(d, "coords")]
    torus = " x ".join(str(max(c) + 1) for c in zip(*coords)) if coords else "?"
    raise ConfigError(
        f"config.mesh: the axes {ici} within a slice do not lay out on its "
        f"{len(slice_devices)} {slice_devices[0].device_kind} devices (chips {torus}): each "
        f"axis must be a product of whole physical axes; choose sizes that are, move a "
        f"factor across slices (mesh.dcn_*) or set mesh.split_physical_axes "
        f"({type(e).__name__}: {str(e).splitlines()[0]})"
    ) from None


def slices_along(mesh: Mesh) -> dict[str, int]:
  """How many TPU slices (`slice_index`) each mesh axis spans; 1: it stays within a slice."""
  ids = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
  return {a: len(set(np.moveaxis(ids, i, 0)[(slice(None),) + (0,) * (ids.ndim - 1)]))
          for i, a in enumerate(mesh.axis_names)}

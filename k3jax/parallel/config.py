"""The `mesh` section (`k3jax.parallel.mesh`): `mesh_config()` and `validate_mesh`."""

from __future__ import annotations

import ml_collections

from k3jax.config_error import check
from k3jax.parallel.mesh import MESH_AXES

EXPERT_SPLITS = ("batch", "seq")  # what mesh.expert splits outside the MoE (parallel.rules)


def mesh_config() -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.data = -1            # -1: the devices the other axes leave
  p.fsdp = 1
  p.expert = 1
  p.context = 1          # context parallelism: each sequence's positions split this many ways
  p.tensor = 1
  # What mesh.expert splits outside the MoE: "batch" (rows) or "seq" (long sequences)
  p.expert_splits = "batch"
  # TPU: an axis may take part of a physical torus axis; False: whole physical axes only
  p.split_physical_axes = False
  # Multi-slice: each axis's ways across slices over DCN; they multiply to the slice count
  p.dcn_data = 1
  p.dcn_fsdp = 1
  p.dcn_expert = 1
  p.dcn_context = 1
  p.dcn_tensor = 1
  return p


def validate_mesh(p: ml_collections.ConfigDict) -> None:
  """ConfigError naming the first impossible setting of the `mesh` section."""
  for axis in MESH_AXES:
    dcn = p[f"dcn_{axis}"]
    check(dcn >= 1, f"mesh.dcn_{axis}", f"must be >= 1 (slices along mesh.{axis}), got {dcn}")
    check(p[axis] == -1 or p[axis] % dcn == 0, f"mesh.dcn_{axis}",
          f"{dcn} slices do not divide mesh.{axis}={p[axis]} (its ICI part must be whole)")
  check(p.expert_splits in EXPERT_SPLITS, "mesh.expert_splits",
        f"must be one of {EXPERT_SPLITS}, got {p.expert_splits!r}")

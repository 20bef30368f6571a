"""The `mesh` section of the experiment config, the device mesh's axes (`k3jax.parallel.mesh`):
its fields and defaults (`mesh_config()`) and `validate_mesh`, which names the first
impossible setting of the section. Whether the axes divide the model's heads and experts,
or the sequence, is `k3jax.config.validate`'s to check."""

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
  # The token dimension mesh.expert splits outside the MoE layers: "batch" (rows) or "seq"
  # (positions, with mesh.context: sequences too long for a row per expert device)
  p.expert_splits = "batch"
  # TPU: an axis may take part of a physical torus axis (e.g. 4 x 2 of an 8-chip ring);
  # its collectives then use part of a ring. False: each axis is whole physical axes.
  p.split_physical_axes = False
  # Multi-slice TPU: how many of each axis's ways run across slices over DCN (the rest, the
  # ICI part mesh.<axis> / dcn_<axis>, stay within a slice); they multiply to the number of
  # slices. Usually data parallelism alone crosses DCN: dcn_data = slices.
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

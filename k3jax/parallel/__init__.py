"""Where arrays live: the device mesh from the config and the logical-axis rules."""

from k3jax.parallel.mesh import MESH_AXES, make_mesh, mesh_shape, slices, slices_along
from k3jax.parallel.sharding import (EXPERT_SPLITS, RULES, batch_spec, check_divisible,
                                     param_specs, rules, shardings, state_shardings)

__all__ = ["EXPERT_SPLITS", "MESH_AXES", "RULES", "batch_spec", "check_divisible", "make_mesh",
           "mesh_shape", "param_specs", "rules", "shardings", "slices", "slices_along",
           "state_shardings"]

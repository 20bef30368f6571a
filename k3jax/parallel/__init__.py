"""Where arrays live: the device mesh from the config and the logical-axis rules."""

from k3jax.parallel.mesh import MESH_AXES, make_mesh, mesh_shape, slices, slices_along
from k3jax.parallel.sharding import (RULES, batch_spec, check_divisible, param_specs,
                                     shardings, state_shardings)

__all__ = ["MESH_AXES", "RULES", "batch_spec", "check_divisible", "make_mesh",
           "mesh_shape", "param_specs", "shardings", "slices", "slices_along", "state_shardings"]

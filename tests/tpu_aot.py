"""Compile for a TPU without one: a Mesh over a compile-only TPU topology from libtpu.

    from tpu_aot import tpu_mesh                  # tests/ is on sys.path under pytest
    mesh = tpu_mesh(("data",))                     # v5p 2x2x1: 4 chips, one axis
    spec = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(f).lower(spec).compile()   # Mosaic kernels are compiled by libtpu

libtpu (the `test` extra) supplies the compiler; no TPU, driver or metadata server is
needed (conftest sets TPU_SKIP_MDS_QUERY, and ALLOW_MULTIPLE_LIBTPU_LOAD so that several
xdist workers may load libtpu). Tests that need it call `tpu_mesh`, which skips them where
libtpu is not installed. The persistent compilation cache cannot read back executables
compiled for a device-less topology: later runs warn once and compile again.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

TOPOLOGY = "v5p:2x2x1"  # 4 chips of 2 TensorCores each (megacore)


@functools.cache
def tpu_topology(name=TOPOLOGY, num_slices=1):
  """libtpu's compile-only description of `num_slices` TPU slices joined by DCN (its
  .devices are TpuDevices; `slice_index` says which slice)."""
  from jax.experimental import topologies  # noqa: PLC0415
  kw = {"num_slices": num_slices} if num_slices > 1 else {}
  return topologies.get_topology_desc(topology_name=name, platform="tpu", **kw)


def tpu_devices(name=TOPOLOGY, num_slices=1):
  """The topology's devices; skips the calling test where libtpu is missing."""
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[test]')")
  return list(tpu_topology(name, num_slices).devices)


def tpu_mesh(axis_names, shape=None, name=TOPOLOGY):
  """A jax.sharding.Mesh over the topology's devices; shape defaults to all devices on
  one axis. Skips the calling test where libtpu is missing."""
  import jax
  devices = tpu_devices(name)
  shape = shape or (len(devices),) + (1,) * (len(axis_names) - 1)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), axis_names)


def tiny_kernel_config():
  """micro_config cut to one hybrid cycle + the final MLA, with the KDA Pallas kernels and
  the Newton-Schulz kernel ("auto" picks Mosaic on TPU), bf16 compute; mesh data 2 x fsdp 2."""
  from conftest import micro_config

  from k3jax import config as k3config
  cfg = micro_config()
  with cfg.unlocked():
    cfg.model.num_layers = 5
    cfg.model.dtype = "bfloat16"
    cfg.model.kda.backend = "kernel"
    cfg.mesh.data, cfg.mesh.fsdp = 2, 2
  return k3config.validate(cfg)


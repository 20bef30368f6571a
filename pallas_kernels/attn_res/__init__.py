"""The Block AttnRes read (K3_SPEC 3): `attend` dispatches to `reference.py` or the Triton
kernels of `kernel.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.attn_res.kernel import attend_pallas, supports
from pallas_kernels.attn_res.reference import Sources, attend_reference, is_buffer, sources_shape
from pallas_kernels.backends import check_backend
from pallas_kernels.platform import target_platform
from pallas_kernels.shard_types import axis_size

__all__ = ["BACKENDS", "attend", "attend_pallas", "attend_reference", "is_buffer"]

# "auto": "kernel" on GPU where the shapes fit the kernels, else "reference"
BACKENDS = ("reference", "kernel", "interpret", "auto")


def attend(sources: Sources, valid: jax.Array | None, query: jax.Array,
           key_gain: jax.Array, eps: float, *, backend: str = "reference", mesh=None,
           batch_axis=None, seq_axis=None, platform=None) -> jax.Array:
  """`attend_reference` through `backend`: sources [S, B, T, d] or S arrays [B, T, d], valid
  [S] bool or None, query, key_gain [d] -> h [B, T, d]. The kernels run per device under
  `shard_map` over batch_axis and seq_axis (d is whole on every device: the reads reduce
  over it)."""
  check_backend("attn-res", backend, BACKENDS)
  split = mesh is not None and (batch_axis is not None or seq_axis is not None)
  if backend == "auto":
    S, B, T, d = sources_shape(sources)
    if split:
      B, T = B // axis_size(mesh, batch_axis), T // axis_size(mesh, seq_axis)
    fits = supports((S, B, T, d))
    backend = "kernel" if target_platform(mesh, platform) == "gpu" and fits else "reference"
  if backend == "reference":
    return attend_reference(sources, valid, query, key_gain, eps)

  def local(sources, valid, query, key_gain):
    return attend_pallas(sources, valid, query, key_gain, eps,
                         interpret=backend == "interpret")

  if valid is None:
    valid = jnp.ones((sources_shape(sources)[0],), bool)
  if not split:
    return local(sources, valid, query, key_gain)
  spec = (P(None, batch_axis, seq_axis) if is_buffer(sources)
          else type(sources)(P(batch_axis, seq_axis) for _ in sources))
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P(), P()),
                       out_specs=P(batch_axis, seq_axis), check_vma=False)(
                           sources, valid, query, key_gain)

"""KDA's short convolution (causal, depthwise, within documents) + SiLU (+ L2 norm for q, k):
`short_conv` dispatches to `reference.py` or the Triton kernels of `kernel.py`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backends import check_backend
from pallas_kernels.platform import target_platform
from pallas_kernels.short_conv.kernel import short_conv_pallas
from pallas_kernels.short_conv.reference import short_conv_reference

__all__ = ["BACKENDS", "short_conv", "short_conv_pallas", "short_conv_reference", "with_halo"]

# "auto": "kernel" on GPU, else "reference" (Mosaic cannot gather rows)
BACKENDS = ("reference", "kernel", "interpret", "auto")


def short_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array, *,
               normalize: bool = False, backend: str = "reference", mesh=None,
               batch_axis=None, head_axis=None, seq_axis=None, platform=None) -> jax.Array:
  """`short_conv_reference` through `backend`; the kernels run per device under `shard_map`
  over batch_axis and head_axis; seq_axis splits T for every backend (`with_halo`)."""
  check_backend("short-conv", backend, BACKENDS)
  if backend == "auto":
    backend = "kernel" if target_platform(mesh, platform) == "gpu" else "reference"

  def local(x, weight, segment_ids):
    if backend == "reference":
      return short_conv_reference(x, weight, segment_ids, normalize=normalize)
    return short_conv_pallas(x, weight, segment_ids, normalize=normalize,
                             interpret=backend == "interpret")

  if mesh is not None and seq_axis is not None:
    local = functools.partial(with_halo, local, axis=seq_axis)
  elif mesh is None or backend == "reference" or (batch_axis is None and head_axis is None):
    return local(x, weight, segment_ids)
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  tok = P(batch_axis, seq_axis, head_axis)
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(tok, P(None, head_axis), P(batch_axis, seq_axis)),
                       out_specs=tok, check_vma=False)(x, weight, segment_ids)


def with_halo(conv, x: jax.Array, weight: jax.Array, segment_ids: jax.Array, *, axis):
  """conv on one device's slice of T with the W - 1 tokens before it prepended, from the
  previous device along `axis` (zeros on the first)."""
  halo = weight.shape[0] - 1
  if halo == 0:
    return conv(x, weight, segment_ids)
  if halo > x.shape[1]:
    raise ValueError(f"short_conv: a slice of {x.shape[1]} tokens is shorter than the "
                     f"{halo} tokens the taps read before it")
  n = jax.lax.axis_size(axis)
  prev = [(j, j + 1) for j in range(n - 1)]
  x_prev, ids_prev = (jax.lax.ppermute(a[:, -halo:], axis, perm=prev)
                      for a in (x, segment_ids))
  out = conv(jnp.concatenate([x_prev, x], axis=1), weight,
             jnp.concatenate([ids_prev, segment_ids], axis=1))
  return out[:, halo:]

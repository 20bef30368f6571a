"""KDA's short convolution: causal, depthwise, never across a document boundary, then SiLU
and (for q and k) an L2 norm over the head dimension. `short_conv` dispatches to a
backend; all share `short_conv_reference`'s contract.

Modules: `reference.py` (plain JAX, fp32 inside), `kernel.py` (Pallas Triton kernels with
a custom VJP; interpret mode on any device).
"""

from __future__ import annotations

import jax

from pallas_kernels.platform import target_platform
from pallas_kernels.short_conv.kernel import short_conv_pallas
from pallas_kernels.short_conv.reference import short_conv_reference

__all__ = ["BACKENDS", "short_conv", "short_conv_pallas", "short_conv_reference"]

# "reference": plain JAX; "kernel": the Triton kernels (GPU only); "interpret": the same
# kernels in Pallas interpret mode (any device, slow, for tests); "auto": "kernel" on GPU,
# "reference" elsewhere (Mosaic cannot gather rows, see kernel.py).
BACKENDS = ("reference", "kernel", "interpret", "auto")


def short_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array, *,
               normalize: bool = False, backend: str = "reference", mesh=None,
               batch_axis=None, head_axis=None, platform=None) -> jax.Array:
  """silu(causal depthwise conv of x) [B, T, H, D] in x's dtype, L2-normalized over D if
  `normalize`; x [B, T, H, D], weight [W, H, D], segment_ids [B, T] (see
  `short_conv_reference`). mesh, batch_axis, head_axis: where x is sharded; the kernels then
  run per device under `shard_map` (nothing is communicated: rows and heads are
  independent). platform: as in `pallas_kernels.kda.kda`."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown short-conv backend {backend!r}; choose one of {BACKENDS}")
  if backend == "auto":
    backend = "kernel" if target_platform(mesh, platform) == "gpu" else "reference"
  if backend == "reference":
    return short_conv_reference(x, weight, segment_ids, normalize=normalize)

  def local(x, weight, segment_ids):
    return short_conv_pallas(x, weight, segment_ids, normalize=normalize,
                             interpret=backend == "interpret")

  if mesh is None or (batch_axis is None and head_axis is None):
    return local(x, weight, segment_ids)
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  tok = P(batch_axis, None, head_axis)
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(local, mesh=mesh, in_specs=(tok, P(None, head_axis), P(batch_axis)),
                       out_specs=tok, check_vma=False)(x, weight, segment_ids)

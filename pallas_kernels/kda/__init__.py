"""Kimi Delta Attention ops: `kda` dispatches to a backend; all take `kda_naive`'s contract."""

import functools

from pallas_kernels.backends import check_backend
from pallas_kernels.kda.chunk import LOWER_BOUND, kda_chunk
from pallas_kernels.kda.context import kda_context, kda_context_sharded
from pallas_kernels.kda.context_kernel import kda_pallas_context
from pallas_kernels.kda.naive import kda_naive
from pallas_kernels.kda.pallas import default_chunk, kda_pallas, kda_pallas_sharded
from pallas_kernels.platform import target_platform
from pallas_kernels.shard_types import axis_size

__all__ = ["BACKENDS", "LOWER_BOUND", "RENAMED", "default_chunk_size", "kda", "kda_chunk",
           "kda_context", "kda_naive", "kda_pallas", "kda_pallas_context", "resolve_backend"]

# "reference": `chunk.py`; "naive": the literal recurrence; "kernel": Triton on GPU, Mosaic
# on TPU; "interpret": the kernels interpreted; "auto": "kernel" on TPU and GPU.
BACKENDS = ("reference", "naive", "kernel", "interpret", "auto")
RENAMED = {"chunk": "reference"}  # old: new


def resolve_backend(backend: str, platform: str) -> str:
  """The backend "auto" stands for on platform ("gpu", "tpu", "cpu"); others unchanged."""
  if backend != "auto":
    return backend
  return "kernel" if platform in ("gpu", "tpu") else "reference"


def default_chunk_size(backend: str, platform: str) -> int:
  """The chunk length when none is named: `pallas.default_chunk` for the kernel, else 64."""
  backend = resolve_backend(backend, platform)
  return default_chunk(platform) if backend == "kernel" else 64


def kda(q, k, v, g, beta, *, backend="reference", scale=None, initial_state=None,
        segment_ids=None, output_final_state=False, chunk_size=None, sub_chunk_size=16,
        mesh=None, batch_axis=None, head_axis=None, seq_axis=None, platform=None,
        bounded_gate=True):
  """KDA through `backend`. chunk_size None: `default_chunk_size`, halved under seq_axis
  until it divides each device's slice. mesh, batch_axis, head_axis: the kernels run per
  device under `shard_map` (XLA does not partition a Pallas call); seq_axis splits T for
  every backend (`context.py`; the kernels off TPU: `context_kernel.py`). platform:
  `target_platform`'s. bounded_gate: g >= LOWER_BOUND (K3's gate); False: any g <= 0 (the
  softplus gate), on every backend.
  Returns o [B, T, H, V], and the final state [B, H, K, V] if output_final_state."""
  common = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                output_final_state=output_final_state)
  platform = target_platform(mesh, platform)
  check_backend("KDA", backend, BACKENDS, RENAMED)
  split = mesh is not None and seq_axis is not None
  if not chunk_size:
    chunk_size = default_chunk_size(backend, platform)
    while split and chunk_size > 16 and (q.shape[1] // axis_size(mesh, seq_axis)) % chunk_size:
      chunk_size //= 2
  backend = resolve_backend(backend, platform)
  interpret = backend == "interpret"
  kernel = dict(chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, interpret=interpret,
                platform="cpu" if interpret else platform, bounded_gate=bounded_gate)
  run = {"reference": functools.partial(kda_chunk, chunk_size=chunk_size,
                                        sub_chunk_size=sub_chunk_size,
                                        bounded_gate=bounded_gate),
         "naive": kda_naive}.get(backend, functools.partial(kda_pallas, **kernel))
  if split:
    # the kernels chain their own spans across devices; TPU's (no transitions) run twice
    local = (functools.partial(kda_pallas_context, scale=scale, **kernel)
             if backend in ("kernel", "interpret") and kernel["platform"] != "tpu"
             else functools.partial(kda_context, functools.partial(run, scale=scale)))
    return kda_context_sharded(local, q, k, v, g, beta,
                               mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis,
                               head_axis=head_axis, initial_state=initial_state,
                               segment_ids=segment_ids, output_final_state=output_final_state)
  if backend in ("reference", "naive"):
    return run(q, k, v, g, beta, **common)
  if mesh is not None and (batch_axis is not None or head_axis is not None):
    return kda_pallas_sharded(q, k, v, g, beta, mesh=mesh, batch_axis=batch_axis,
                              head_axis=head_axis, **kernel, **common)
  return kda_pallas(q, k, v, g, beta, **kernel, **common)

"""Kimi Delta Attention ops: `kda` dispatches to a backend; all share one contract
(arrays [B, T, H, ...], see `kda_naive`)."""

import jax

from pallas_kernels.kda.chunk import LOWER_BOUND, kda_chunk
from pallas_kernels.kda.naive import kda_naive
from pallas_kernels.kda.pallas import kda_pallas, kda_pallas_sharded

__all__ = ["BACKENDS", "LOWER_BOUND", "kda", "kda_chunk", "kda_naive", "kda_pallas"]

# "kernel": the Pallas kernels compiled for the target platform (Triton on GPU, Mosaic on
# TPU); "interpret": the same kernels in Pallas interpret mode (any device, slow);
# "auto": "kernel" on TPU (one k3_full layer's gradient: 1.82 GiB of temporaries per chip vs
# 8.90 for "chunk"), "chunk" elsewhere: on the H200 the kernel alone is 4.6x faster than
# "chunk" but k3_small's KDA layer around it is slower, not yet explained
# (benchmarks/results/kda.md, session 6).
BACKENDS = ("chunk", "naive", "kernel", "interpret", "auto")


def kda(q, k, v, g, beta, *, backend="chunk", scale=None, initial_state=None,
        segment_ids=None, output_final_state=False, chunk_size=64, sub_chunk_size=16,
        mesh=None, batch_axis=None, head_axis=None, platform=None):
  """KDA through the named backend (one of BACKENDS).

  chunk_size and sub_chunk_size apply to "chunk" and the kernels. mesh, batch_axis,
  head_axis: where the arrays are sharded (mesh axis names, or None); the kernels then
  run per device under `shard_map` (a Pallas call is not partitioned by XLA), the
  pure-JAX backends ignore them. platform: what the program is compiled for ("gpu",
  "tpu", "cpu"); None: the platform of the mesh's devices, else `jax.default_backend()`.
  A mesh over a compile-only TPU topology (`k3jax.aot`) thus gets the Mosaic kernels on a
  CPU host. Returns what the backend returns: o [B, T, H, V], plus the final state
  [B, H, K, V] if output_final_state.
  """
  common = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                output_final_state=output_final_state)
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  platform = "gpu" if platform == "cuda" else platform
  if backend == "auto":
    backend = "kernel" if platform == "tpu" else "chunk"
  if backend == "chunk":
    return kda_chunk(q, k, v, g, beta, chunk_size=chunk_size,
                     sub_chunk_size=sub_chunk_size, **common)
  if backend == "naive":
    return kda_naive(q, k, v, g, beta, **common)
  if backend in ("kernel", "interpret"):
    interpret = backend == "interpret"
    kernel = dict(chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, interpret=interpret,
                  platform="cpu" if interpret else platform)
    if mesh is not None and (batch_axis is not None or head_axis is not None):
      return kda_pallas_sharded(q, k, v, g, beta, mesh=mesh, batch_axis=batch_axis,
                                head_axis=head_axis, **kernel, **common)
    return kda_pallas(q, k, v, g, beta, **kernel, **common)
  raise ValueError(f"unknown KDA backend {backend!r}; choose one of {BACKENDS}")

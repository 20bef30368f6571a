"""Kimi Delta Attention ops: `kda` dispatches to a backend; all share one contract
(arrays [B, T, H, ...], see `kda_naive`)."""

from pallas_kernels.kda.chunk import LOWER_BOUND, kda_chunk
from pallas_kernels.kda.naive import kda_naive

__all__ = ["BACKENDS", "LOWER_BOUND", "kda", "kda_chunk", "kda_naive"]

BACKENDS = ("chunk", "naive")


def kda(q, k, v, g, beta, *, backend="chunk", scale=None, initial_state=None,
        segment_ids=None, output_final_state=False, chunk_size=64, sub_chunk_size=16):
  """KDA through the named backend: "chunk" (default) or "naive".

  chunk_size and sub_chunk_size only apply to "chunk". Returns what the backend returns:
  o [B, T, H, V], plus the final state [B, H, K, V] if output_final_state.
  """
  common = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                output_final_state=output_final_state)
  if backend == "chunk":
    return kda_chunk(q, k, v, g, beta, chunk_size=chunk_size,
                     sub_chunk_size=sub_chunk_size, **common)
  if backend == "naive":
    return kda_naive(q, k, v, g, beta, **common)
  raise ValueError(f"unknown KDA backend {backend!r}; choose one of {BACKENDS}")

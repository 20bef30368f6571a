"""cuDNN's fused flash attention over documents (Hopper or later): unpacked (a length per
row) or packed (each row's runs of one id as ragged sequences), whose fp32 dq accumulator is
[B * M, T, H, Dqk] for M run slots a row, so `run_slots` bounds M."""

from __future__ import annotations

import jax
import jax.numpy as jnp

RUN_SLOTS_BYTES = 2**32   # budget for cuDNN's fp32 dq accumulator, B * M * T * H * Dqk * 4
MAX_RUN_SLOTS = 64


def run_slots(b: int, t: int, h: int, d: int) -> int:
  """M within RUN_SLOTS_BYTES, in [2, MAX_RUN_SLOTS] (one slot is the unpacked form)."""
  return max(2, min(MAX_RUN_SLOTS, RUN_SLOTS_BYTES // (b * t * h * d * 4)))


def segment_runs(segment_ids: jax.Array, slots: int):
  """[B, T] ids -> cuDNN's packed layout of the runs of nonzero ids: offsets [B, slots + 1],
  lengths [B, slots] (-1 past the last run), and the runs per row [B]."""
  ids = segment_ids
  real = ids != 0
  changed = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  first = real & changed
  last = real & jnp.concatenate([changed[:, 1:], jnp.ones_like(ids[:, :1], bool)], 1)

  def row(first, last):
    start = jnp.nonzero(first, size=slots, fill_value=-1)[0].astype(jnp.int32)
    end = jnp.nonzero(last, size=slots, fill_value=-2)[0].astype(jnp.int32) + 1
    lengths = jnp.where(start >= 0, end - start, -1)
    return jnp.concatenate([start, jnp.full((1,), -1, jnp.int32)]), lengths

  offsets, lengths = jax.vmap(row)(first, last)
  return offsets, lengths, jnp.sum(first, axis=1)


def flash_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                scale: float, causal: bool, slots: int) -> jax.Array:
  """slots = 1: unpacked, a document a row from position 0; else <= slots runs a row (v padded
  to Dqk: offsets use q's stride). Rows beyond these bounds are wrong: `flash_cuda` checks."""
  # JAX's public dot_product_attention takes neither Dv != Dqk nor packed rows
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  dv, dtype = v.shape[-1], q.dtype
  mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  # cuDNN leaves padding rows' gradients unwritten: zeroed inputs make them exactly zero
  real = (segment_ids != 0)[:, :, None, None]
  q, k = jnp.where(real, q, 0), jnp.where(real, k.astype(dtype), 0)
  v_real = jnp.where(real, v.astype(dtype), 0)
  if slots == 1:
    vp = v_real
    lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
    out = cudnn.dot_product_attention(q, k, vp, q_seqlen=lengths, kv_seqlen=lengths,
                                      scale=scale, mask_type=mask)
  else:
    vp = jnp.pad(v_real, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
    offsets, lengths, _ = segment_runs(segment_ids, slots)
    out = cudnn.dot_product_attention(q, k, vp, q_seqlen=lengths, kv_seqlen=lengths,
                                      q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                      mask_type=mask)
  return jnp.where(real, out[..., :dv], v.astype(dtype)).astype(v.dtype)


def cudnn_ready() -> bool:
  """cuDNN's packed flash attention runs here: JAX found cuDNN and a Hopper or later GPU."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
    cudnn.check_cudnn_version()
    return cudnn.check_compute_capability("9.0")
  except (ImportError, RuntimeError):
    return False

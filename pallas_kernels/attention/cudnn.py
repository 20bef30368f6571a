"""cuDNN's fused flash attention (GPU, Hopper or later; through JAX's cuDNN binding) over
documents: a row of one document from its first token takes cuDNN's unpacked form (a
length per row); otherwise each row's segments are cut into contiguous runs of one id and
given to cuDNN as ragged sequences (its packed form). Causal or full within each.

In the packed form cuDNN holds its fp32 dq accumulator per (row, run slot) at the full row
length ([B * M, T, H, Dqk] for M run slots a row), so M is bounded by a byte budget
(`run_slots`); the dispatcher sends rows with more runs to another kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RUN_SLOTS_BYTES = 2**32   # budget for cuDNN's fp32 dq accumulator, B * M * T * H * Dqk * 4
MAX_RUN_SLOTS = 64


def run_slots(b: int, t: int, h: int, d: int) -> int:
  """M, the runs a row may have on the cuDNN path: as many as RUN_SLOTS_BYTES holds, at
  least 2 (one run slot would be cuDNN's unpacked form), at most MAX_RUN_SLOTS."""
  return max(2, min(MAX_RUN_SLOTS, RUN_SLOTS_BYTES // (b * t * h * d * 4)))


def segment_runs(segment_ids: jax.Array, slots: int):
  """[B, T] ids (0 = padding) -> the runs of equal nonzero ids per row, as cuDNN's packed
  layout takes them: offsets [B, slots + 1] (run starts, then -1), lengths [B, slots]
  (-1 past the last run), and the number of runs [B] (more than `slots`: not all listed)."""
  ids = segment_ids
  real = ids != 0
  changed = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  first = real & changed                                         # a run starts here
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
  """q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; segment_ids [B, T] (0 = padding), each
  document one contiguous run. -> [B, T, H, Dv] in v's dtype; a padding token sees only
  itself (its output is its own value), as in the dense reference.

  slots = 1: each row holds at most one document, starting at position 0 (cuDNN's
  unpacked form: a length per row). slots >= 2: at most `slots` runs a row (cuDNN's packed
  form; its ragged offsets count elements of q's token stride, H * Dqk, for k and v alike,
  so v is zero-padded to Dqk). Rows beyond these bounds give wrong results: the dispatcher
  (`flash_cuda`) checks `segment_runs` first."""
  # JAX's public dot_product_attention takes neither Dv != Dqk nor packed rows
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  dv, dtype = v.shape[-1], q.dtype
  mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  # cuDNN leaves the gradient rows of tokens in no sequence (padding) unwritten: selecting
  # zeros there makes their gradient exactly zero, whatever the buffers held
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

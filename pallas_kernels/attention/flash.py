"""Flash attention by JAX's Pallas library kernels: splash (TPU) and Triton `mha` (GPU). Both
mask by `q_id == kv_id` alone, so each padding token gets an id of its own: it sees itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128         # splash blocks are multiples of the TPU lane width
TPU_BLOCK = 512     # splash q / kv block (MaxText's default) where T allows
GPU_BLOCK_BYTES = 128  # Triton forward block = this / itemsize: fits H200 shared memory
GPU_BWD_BLOCK = 32
def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def unique_padding_ids(segment_ids: jax.Array) -> jax.Array:
  """[B, T] ids, each padding token's 0 replaced by -1 - its position (real ids > 0)."""
  pos = jnp.arange(segment_ids.shape[-1], dtype=segment_ids.dtype)
  return jnp.where(segment_ids == 0, -1 - pos, segment_ids)


def _pad_rows(x: jax.Array, t: int) -> jax.Array:
  return jnp.pad(x, [(0, 0), (0, t - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _pad_ids(ids: jax.Array, t: int, start: int) -> jax.Array:
  """ids [B, T0] -> [B, t], new rows with ids of their own, below `unique_padding_ids`'."""
  extra = -1 - (start + jnp.arange(t - ids.shape[1], dtype=ids.dtype))
  return jnp.concatenate([ids, jnp.broadcast_to(extra, (ids.shape[0], extra.shape[0]))], 1)


def flash_tpu(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, kv_ids: jax.Array,
              *, scale: float, causal: bool, interpret: bool = False,
              block: int = TPU_BLOCK) -> jax.Array:
  """Splash: q [B, Tq, H, Dqk], k, v [B, Tk, H (or both 1), D] -> [B, Tq, H, Dv]; causal
  aligns the queries with the last Tq keys."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415
  b, tq, h, _ = q.shape
  tk = k.shape[1]
  bq, bkv = (min(block, _round_up(n, LANES)) for n in (tq, tk))
  tq_p, tk_p = _round_up(tq, bq), _round_up(tk, bkv)
  shape = (tq_p, tk_p)
  mask = splash.CausalMask(shape, offset=tk - tq) if causal else splash.FullMask(shape)
  blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                             block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                             block_q_dq=bq, block_kv_dq=bkv)
  shared = k.shape[2] == v.shape[2] == 1
  make = splash.make_splash_mqa if shared else splash.make_splash_mha
  kernel = make(splash.MultiHeadMask([mask] * h), block_sizes=blocks, head_shards=1,
                q_seq_shards=1, interpret=interpret)
  heads_major = lambda x, t: jnp.swapaxes(_pad_rows(x, t), 1, 2)        # noqa: E731
  kv_layout = (lambda x, t: _pad_rows(x, t)[:, :, 0]) if shared else heads_major
  ids = splash.SegmentIds(q=_pad_ids(q_ids, tq_p, tk), kv=_pad_ids(kv_ids, tk_p, tk))
  # splash has no softmax scale: it goes into q
  out = jax.vmap(kernel)(heads_major(q * jnp.asarray(scale, q.dtype), tq_p),
                         kv_layout(k.astype(q.dtype), tk_p),
                         kv_layout(v.astype(q.dtype), tk_p), ids)
  return jnp.swapaxes(out, 1, 2)[:, :tq].astype(v.dtype)


def flash_gpu(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, *, scale: float,
              causal: bool, interpret: bool = False) -> jax.Array:
  """Triton `mha`: q, k [B, T, H, Dqk], v [B, T, H, Dv], one ids [B, T] -> [B, T, H, Dv]."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
  t, dv = q.shape[1], v.shape[-1]
  d = max(q.shape[-1], dv)
  block = GPU_BLOCK_BYTES // jnp.dtype(q.dtype).itemsize
  t_p = _round_up(t, block)
  pad = lambda x: jnp.pad(_pad_rows(x, t_p).astype(q.dtype),           # noqa: E731
                          [(0, 0)] * 3 + [(0, d - x.shape[-1])])
  blocks = gpu_attention.BlockSizes(block_q=block, block_k=block,
                                    block_q_dkv=GPU_BWD_BLOCK, block_kv_dkv=GPU_BWD_BLOCK,
                                    block_q_dq=GPU_BWD_BLOCK, block_kv_dq=GPU_BWD_BLOCK)
  out = gpu_attention.mha(pad(q), pad(k), pad(v), _pad_ids(ids, t_p, t), sm_scale=scale,
                          causal=causal, block_sizes=blocks, interpret=interpret)
  return out[:, :t, :, :dv].astype(v.dtype)

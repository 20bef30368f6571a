"""Memory-efficient attention through JAX's own Pallas library kernels. Nothing here
materializes [T, T] scores.

  TPU: splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`): causal or
       full mask, q and kv segment ids, Dv != Dqk, any head dim, custom VJP with segment
       ids in both backward kernels. Also run in Pallas interpret mode (CPU tests).
  GPU: `jax.experimental.pallas.ops.gpu.attention.mha` (Triton): causal, one segment-id
       array shared by queries and keys, custom VJP with segment ids. It needs
       Dqk == Dv (v is zero-padded to Dqk; its head dim is padded to a power of two inside,
       192 -> 256) and T a multiple of its blocks.

Both kernels take the segment mask only (`q_id == kv_id`); the callers pass ids from
`unique_padding_ids`, which give every padding token an id of its own, so a padding token
sees only itself, exactly the dense reference's rule, and no row is ever empty. Rows added
to reach a block multiple get ids of their own too and are sliced off.

Neither kernel returns the softmax's row maxima (splash writes only the log-sum-exp, which
is not the max: it exceeds it by up to log T); `max_logit.py` computes the QK-Clip max logit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128         # splash blocks are multiples of the TPU lane width
TPU_BLOCK = 512     # splash q / kv block (MaxText's default) where T allows
GPU_BLOCK_BYTES = 128  # Triton forward q / kv block = this / itemsize (bf16: 64, fp32: 32): the
                       # q tile and two stages of k, v tiles [block, 256] fit H200 shared memory
GPU_BWD_BLOCK = 32  # Triton backward blocks (the library default)
def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def unique_padding_ids(segment_ids: jax.Array) -> jax.Array:
  """[B, T] ids with each padding token (id 0) replaced by -1 - its position: the
  kernels' plain `q_id == kv_id` mask then lets it see only itself. Real ids must be > 0."""
  pos = jnp.arange(segment_ids.shape[-1], dtype=segment_ids.dtype)
  return jnp.where(segment_ids == 0, -1 - pos, segment_ids)


def _pad_rows(x: jax.Array, t: int) -> jax.Array:
  """x [B, T0, ...] zero-padded to [B, t, ...]."""
  return jnp.pad(x, [(0, 0), (0, t - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _pad_ids(ids: jax.Array, t: int, start: int) -> jax.Array:
  """ids [B, T0] extended to [B, t]; the new rows get ids -1 - (start + j), below every id
  `unique_padding_ids` gives a sequence of `start` tokens, so they see only themselves."""
  extra = -1 - (start + jnp.arange(t - ids.shape[1], dtype=ids.dtype))
  return jnp.concatenate([ids, jnp.broadcast_to(extra, (ids.shape[0], extra.shape[0]))], 1)


def flash_tpu(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, kv_ids: jax.Array,
              *, scale: float, causal: bool, interpret: bool = False,
              block: int = TPU_BLOCK) -> jax.Array:
  """Splash attention. q: [B, Tq, H, Dqk]; k: [B, Tk, H, Dqk]; v: [B, Tk, H, Dv] (or k, v
  both with 1 head, shared by all: splash's multi-query kernel);
  q_ids [B, Tq], kv_ids [B, Tk] (from `unique_padding_ids`). Causal aligns the queries with
  the last Tq keys: query t sees keys s <= t + Tk - Tq (the usual mask when Tq == Tk).
  -> [B, Tq, H, Dv] in v's dtype. interpret: Pallas interpret mode (any platform).
  block: the largest q / kv block (a multiple of 128; T is padded to a block multiple)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415
  b, tq, h, _ = q.shape
  tk = k.shape[1]
  bq, bkv = (min(block, _round_up(n, LANES)) for n in (tq, tk))
  tq_p, tk_p = _round_up(tq, bq), _round_up(tk, bkv)
  # padded query rows see the padded key rows of their own ids (_pad_ids), none is empty
  shape = (tq_p, tk_p)
  mask = splash.CausalMask(shape, offset=tk - tq) if causal else splash.FullMask(shape)
  blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                             block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                             block_q_dq=bq, block_kv_dq=bkv)
  shared = k.shape[2] == v.shape[2] == 1   # multi-query: k [T, Dqk], v [T, Dv] per row
  make = splash.make_splash_mqa if shared else splash.make_splash_mha
  kernel = make(splash.MultiHeadMask([mask] * h), block_sizes=blocks, head_shards=1,
                q_seq_shards=1, interpret=interpret)
  heads_major = lambda x, t: jnp.swapaxes(_pad_rows(x, t), 1, 2)        # noqa: E731
  kv_layout = (lambda x, t: _pad_rows(x, t)[:, :, 0]) if shared else heads_major
  ids = splash.SegmentIds(q=_pad_ids(q_ids, tq_p, tk), kv=_pad_ids(kv_ids, tk_p, tk))
  # splash has no softmax scale: it goes into q
  out = jax.vmap(kernel)(heads_major(q * jnp.asarray(scale, q.dtype), tq_p),
                         kv_layout(k.astype(q.dtype), tk_p),
                         kv_layout(v.astype(q.dtype), tk_p), ids)       # [B, H, Tq_p, Dv]
  return jnp.swapaxes(out, 1, 2)[:, :tq].astype(v.dtype)


def flash_gpu(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, *, scale: float,
              causal: bool, interpret: bool = False) -> jax.Array:
  """Triton attention (`mha`). q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; ids [B, T] (from
  `unique_padding_ids`, for queries and keys alike). -> [B, T, H, Dv] in v's dtype."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
  t, dv = q.shape[1], v.shape[-1]
  d = max(q.shape[-1], dv)
  block = GPU_BLOCK_BYTES // jnp.dtype(q.dtype).itemsize
  t_p = _round_up(t, block)
  pad = lambda x: jnp.pad(_pad_rows(x, t_p).astype(q.dtype),           # noqa: E731
                          [(0, 0)] * 3 + [(0, d - x.shape[-1])])       # zero dims add nothing
  blocks = gpu_attention.BlockSizes(block_q=block, block_k=block,
                                    block_q_dkv=GPU_BWD_BLOCK, block_kv_dkv=GPU_BWD_BLOCK,
                                    block_q_dq=GPU_BWD_BLOCK, block_kv_dq=GPU_BWD_BLOCK)
  out = gpu_attention.mha(pad(q), pad(k), pad(v), _pad_ids(ids, t_p, t), sm_scale=scale,
                          causal=causal, block_sizes=blocks, interpret=interpret)
  return out[:, :t, :, :dv].astype(v.dtype)

"""Chunked Kimi Delta Attention as Pallas kernels, forward and backward (K3_SPEC 2.1).

Five kernels (`chunk_kernels.py`: prep, chunk_cots, chunk_bwd; `recurrence.py`: rec_fwd,
rec_bwd; their settings and blocks: `blocks.py`), one `jax.custom_vjp` (here):
  prep       grid (B, H, N), one chunk per program: decays, scores and the UT transform
             (`tile.chunk_prep`), written out as w, u, A_qk, q_s, k_s and the chunk decay.
  rec_fwd    the inter-chunk recurrence, fp32 state (transposed, [BV, K]) per (b, h, V
             block): v_new = u - w S, o = q_s S + A_qk v_new, S <- dec S + k_s^T v_new.
             Saves the state entering each chunk (operand dtype) for the backward.
  rec_bwd    the sequential part of the backward, chunks in reverse: the state's cotangent
             dS carried back (dS <- dec dS + q_s^T do - w^T dv_new), the cotangents of v_new
             and of the state leaving each chunk written out. Four products per chunk.
  chunk_cots grid (B, H, N), one chunk per program: the products with the states around
             the chunk (v_new recomputed from the saved state), giving the cotangents of
             prep's outputs w, A_qk, q_s, k_s and the decay.
  chunk_bwd  grid (B, H, N), one chunk per program: prep recomputed in registers and its
             vjp derived by hand (`tile.chunk_prep_vjp`): dq, dk, dv, dg, dbeta.
The forward's prep outputs (w, u, A_qk, q_s, k_s, decay) and chunk states are the residuals
(`save_states=False`: recomputed in the backward instead). Columns of V are independent in
the delta rule, so V blocks parallelize the recurrences at no extra work. Long sequences of
few rows and heads also cut the sequence into spans whose recurrences run at once, joined
through each span's affine transition (`spans.py`, `Config.spans`; GPU).

GPU backend: Pallas Triton. Mosaic GPU (wgmma, TMA) is the faster road on the H200, but it
wants warpgroup-shaped tiles staged explicitly through shared memory, and the tile maths
here (masked 2-D matmuls, reductions, iotas on values) would need rewriting around that
memory model. Triton is deprecated in JAX 0.11.2 but runs there, lowers for CUDA from a
CPU-only machine (so tests check the lowering), and its kernel bodies also run in
interpret mode. On GPU and in interpret mode one program loops over the chunks.

TPU backend: Mosaic, the same tile maths; the recurrences put the chunks on a sequential
("arbitrary") last grid axis with the state in VMEM scratch, blocks of (64, 128) for the
MXU, all of V (up to 128) per program. `kda_pallas_sharded` wraps it in shard_map.

Layout: per-token arrays stay [B, T, H, D] on GPU and in interpret mode (a block is one
head's rows, strided); on TPU the wrapper moves them to [B, H, T, D] (`heads_major`). T is
padded to a multiple of the chunk and D to a power of two >= 16 (a copy only when needed).

Speed on the H200 (benchmarks/results/kda.md): chunks of 16 (one diagonal tile) are fastest
on the GPU, and the kernels match or beat fla's; chunk_bwd takes the largest share, bound by
its chain of small dependent tile products rather than by bandwidth or FLOPs. Long sequences
of few rows run faster in spans.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, chunk_kernels, spans
from pallas_kernels.kda.blocks import F32
from pallas_kernels.kda.chunk import check_sub_chunk
from pallas_kernels.platform import target_platform

# block_v=None: the widest V block of 64, 32 or 16 that gives the recurrences this many
# programs, else 16: wide blocks are faster while there are enough programs to fill the GPU,
# narrow ones when there are few rows and heads (benchmarks/results/kda.md).
MIN_PROGRAMS = 256
BLOCKS_V = (64, 32, 16)
# rec_fwd saving states (GPU): V blocks of STATES_BLOCK_V at STATES_WARPS warps where they
# give MIN_PROGRAMS programs (blocks.Config.states_block_v); with fewer programs 2 warps
# were slower (benchmarks/results/kda.md).
STATES_BLOCK_V, STATES_WARPS = 32, 2
# spans=None (GPU): where V blocks of 16 give at most MIN_PROGRAMS programs, the sequence is
# cut into spans (`spans.py`), doubling them while blocks of SPAN_BLOCK_V stay within
# SPAN_PROGRAMS programs and every span keeps MIN_SPAN_CHUNKS chunks: spans pay off for long
# sequences of few rows and cost time on short ones or with many programs already
# (benchmarks/results/kda.md).
SPAN_BLOCK_V, SPAN_PROGRAMS, MIN_SPAN_CHUNKS = 64, 256, 256
# The GPU kernels' chunk lengths: chunk_bwd holds a chunk's prep and its vjp at once; at
# C = 32 it spills registers and runs much slower than at 16, at 64 it needs more shared
# memory than the H200 has (benchmarks/results/kda.md).
GPU_CHUNK, GPU_MAX_CHUNK = 16, 32


def default_chunk(platform: str) -> int:
  """The kernels' chunk length when none is named: GPU_CHUNK on GPU, else 64 (TPU's MXU
  tiles)."""
  return GPU_CHUNK if platform == "gpu" else 64


def default_spans(platform, interpret, B, H, V, n_chunks):
  """How many spans the recurrences run in (`spans.py`) when none is named: on GPU where V
  blocks of 16 give at most MIN_PROGRAMS programs, the most (a power of two) with at most
  SPAN_PROGRAMS programs at blocks of SPAN_BLOCK_V and MIN_SPAN_CHUNKS chunks a span; else
  1."""
  if platform != "gpu" or interpret or B * H * max(1, V // 16) > MIN_PROGRAMS:
    return 1
  n = 1
  while (B * H * max(1, V // SPAN_BLOCK_V) * 2 * n <= SPAN_PROGRAMS
         and n_chunks >= 2 * n * MIN_SPAN_CHUNKS):
    n *= 2
  return n


# ------------------------------------------------------------------------------ custom_vjp


def _forward(cfg, q, k, v, g, beta, st0, masks, save_states):
  """prep and the recurrence: o, the final state, prep's outputs, the chunk states (None
  unless saved) and the spans' transitions (None with one span)."""
  prep = chunk_kernels.prep(cfg, q, k, v, g, beta, *masks)
  o, st, states, trans = spans.forward(cfg, *prep, st0, q.dtype, save_states)
  return o, st, prep, states, trans


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  o, st, *_ = _forward(cfg, q, k, v, g, beta, st0, (doc_c, doc_r, sees, last), False)
  return o, st


def _core_fwd(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  o, st, prep, states, trans = _forward(cfg, q, k, v, g, beta, st0,
                                        (doc_c, doc_r, sees, last), cfg.save_states)
  saved = (*prep, states, trans) if cfg.save_states else None
  return (o, st), (q, k, v, g, beta, st0, doc_c, doc_r, sees, last, saved)


def _core_bwd(cfg, res, cots):
  q, k, v, g, beta, st0, doc_c, doc_r, sees, last, saved = res
  do, dst = cots
  masks = (doc_c, doc_r, sees, last)
  if saved is None:  # recompute prep's outputs, the chunk states and the transitions
    prep = chunk_kernels.prep(cfg, q, k, v, g, beta, *masks)
    saved = (*prep, *spans.forward(cfg, *prep, st0, q.dtype, True)[2:])
  w, u, a, qs, ks, dec, states, trans = saved
  dvn, dstates, dst0 = spans.backward(cfg, w, a, qs, ks, dec, do, dst, trans)
  dw, da, dqs, dks, ddec = chunk_kernels.chunk_cots(cfg, w, u, states, dstates, do, dvn)
  dq, dk, dv, dg, dbeta = chunk_kernels.chunk_bwd(cfg, q, k, v, g, beta, *masks, dw, dvn, da,
                                                  dqs, dks, ddec)
  zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dq, dk, dv, dg, dbeta, dst0,
          zero_int(doc_c), zero_int(doc_r), jnp.zeros_like(sees), jnp.zeros_like(last))


_kda_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------- wrapper


def kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
               output_final_state=False, chunk_size=None, sub_chunk_size=16, interpret=False,
               platform=None, block_v=None, save_states=True, **tuning):
  """Chunked KDA through the Pallas kernels; same contract as `kda_naive`, for any T.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] with chunk.LOWER_BOUND <= g <= 0;
      beta: [B, T, H]. bf16 or fp32; bf16 runs the big matmuls on bf16 operands with
      fp32 accumulation, the state and decays stay fp32 either way.
    scale, initial_state [B, H, K, V], segment_ids [B, T], output_final_state: as in
      `kda_naive`.
    chunk_size: C, a power of two >= 16, at most GPU_MAX_CHUNK on GPU; None: GPU_CHUNK on
      GPU, else 64. sub_chunk_size: L, the diagonal tile length (C % L == 0,
      |LOWER_BOUND| (L - 1) <= 80).
    interpret: run the kernels in Pallas interpret mode (any device, CPU included).
    platform: "gpu" or "tpu"; None: the default backend's.
    block_v: V columns per program of the recurrence (GPU, interpret); None: the widest of
      BLOCKS_V with B * H * spans * V / block_v >= MIN_PROGRAMS, else the narrowest; on GPU
      rec_fwd saving states then takes STATES_BLOCK_V.
    save_states: keep prep's outputs and the state entering each chunk for the backward
      (else recompute them there).
    tuning: further `Config` fields (spans, prep_warps, prep_precision, rec_stages,
      rec_warps, states_block_v, states_warps, cots_warps, bwd_warps, bwd_precision).
      spans None or absent: `default_spans` (GPU: several for long sequences of few rows
      and heads, else 1).

  Returns:
    o [B, T, H, V] in q's dtype, and the final state [B, H, K, V] float32 if requested.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  cfg, args = kernel_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            segment_ids=segment_ids, chunk_size=chunk_size,
                            sub_chunk_size=sub_chunk_size, interpret=interpret,
                            platform=platform, block_v=block_v, save_states=save_states,
                            **tuning)
  o, st = _kda_core(cfg, *args)
  if blocks.heads_major(cfg.platform):
    o = jnp.swapaxes(o, 1, 2)
  o = o[:, :T, :, :V]
  if not output_final_state:
    return o
  return o, jnp.swapaxes(st, -1, -2)[:, :, :K, :V]


def kernel_inputs(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size,
                  sub_chunk_size, interpret, platform, block_v, save_states, **tuning):
  """(Config, the kernels' inputs in their layout (`heads_major`; shapes here as on TPU)):
  q, k, g [B, H, Tp, Kp], v [B, H, Tp, Vp], beta [B, H, Tp, 1], the initial state
  (transposed) [B, H, Vp, Kp], document index [B, Tp, 1] and [B, N, 1, C], and the
  sees/last masks [B, Tp, 1]."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  platform = "cpu" if interpret and platform is None else target_platform(None, platform)
  C, L = chunk_size or default_chunk(platform), sub_chunk_size
  if C & (C - 1) or C < 16:
    raise ValueError(f"chunk_size={C} must be a power of two >= 16")
  if platform == "gpu" and not interpret and C > GPU_MAX_CHUNK:
    raise ValueError(f"chunk_size={C}: the GPU kernels run chunks of at most {GPU_MAX_CHUNK} "
                     f"(at 64 the chunk backward needs more shared memory than a GPU has); "
                     f"{GPU_CHUNK} is the fastest")
  if C % L or L & (L - 1):
    raise ValueError(f"chunk_size={C} is not a multiple of sub_chunk_size={L}, or L is not "
                     "a power of two")
  check_sub_chunk(L)
  Kp, Vp = (max(16, pl.next_power_of_2(d)) for d in (K, V))
  n_spans = tuning.pop("spans", None)
  if n_spans is None:
    n_spans = default_spans(platform, interpret, B, H, Vp, -(-T // C))
  if n_spans < 1 or n_spans & (n_spans - 1) or (platform == "tpu" and n_spans != 1):
    raise ValueError(f"spans={n_spans} must be a power of two (1 on TPU, whose recurrences "
                     "walk the chunks on a sequential grid axis)")
  programs = lambda bv: B * H * n_spans * max(1, Vp // bv)
  if block_v is None:
    block_v = next((bv for bv in BLOCKS_V if programs(bv) >= MIN_PROGRAMS), BLOCKS_V[-1])
    if (platform == "gpu" and "states_block_v" not in tuning and Vp % STATES_BLOCK_V == 0
        and programs(STATES_BLOCK_V) >= MIN_PROGRAMS):
      tuning.update(states_block_v=STATES_BLOCK_V, states_warps=STATES_WARPS)
  cfg = blocks.Config(scale=float(K ** -0.5 if scale is None else scale), chunk=C, sub=L,
               block_v=block_v, mm_dtype=jnp.dtype(q.dtype).name if q.dtype == jnp.bfloat16
               else "float32", interpret=interpret, platform=platform,
               save_states=save_states, spans=n_spans, **tuning)
  pad_t = -T % (C * n_spans)  # every span a whole number of chunks
  Tp, N = T + pad_t, (T + pad_t) // C
  bv = min(block_v, Vp)
  if Vp % bv:
    raise ValueError(f"block_v={block_v} does not divide the padded V={Vp}")

  def layout(x, d_pad):  # [B, T, H, D] -> [B, Tp, H, D + d_pad]; zeros change nothing
    x = jnp.pad(x, [(0, 0), (0, pad_t), (0, 0), (0, d_pad)])
    return jnp.swapaxes(x, 1, 2) if blocks.heads_major(platform) else x

  dt = q.dtype
  qh, kh = (layout(x.astype(dt), Kp - K) for x in (q, k))
  vh = layout(v.astype(dt), Vp - V)
  # g and beta keep their own precision (an fp32 gate stays fp32: its sums set the decays).
  gh = layout(g, Kp - K)
  bh = layout(beta[..., None], 0)

  doc = _document_index(segment_ids, B, T)
  doc = jnp.pad(doc, [(0, 0), (0, pad_t)], mode="edge")  # padding joins the last document
  chunked = doc.reshape(B, N, C)
  # The state entering a chunk belongs to the document of the token before the chunk.
  doc_state = jnp.concatenate([chunked[:, :1, 0], chunked[:, :-1, -1]], axis=1)  # [B, N]
  sees = (chunked == doc_state[..., None]).astype(F32).reshape(B, Tp, 1)
  last = (chunked == chunked[..., -1:]).astype(F32).reshape(B, Tp, 1)
  doc_c, doc_r = doc[..., None], chunked[:, :, None, :]

  if initial_state is None:
    st0 = jnp.zeros((B, H, Vp, Kp), F32)
  else:
    st0 = jnp.swapaxes(jnp.asarray(initial_state, F32), -1, -2)
    st0 = jnp.pad(st0, [(0, 0), (0, 0), (0, Vp - V), (0, Kp - K)])
  return cfg, (qh, kh, vh, gh, bh, st0, doc_c, doc_r, sees, last)


def _document_index(segment_ids, B, T):
  """[B, T] int32 run index (as chunk.py): +1 wherever the id changes."""
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                          jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def kda_pallas_sharded(q, k, v, g, beta, *, mesh, batch_axis=None, head_axis=None,
                       initial_state=None, segment_ids=None, output_final_state=False,
                       **kwargs):
  """`kda_pallas` under `jax.shard_map`: each device runs the kernels on its own slice of
  the batch (mesh axis or axes `batch_axis`) and heads (`head_axis`); nothing is
  communicated, since batch rows and heads are independent. kwargs go to `kda_pallas`."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  tok, row, state = P(batch_axis, None, head_axis), P(batch_axis), P(batch_axis, head_axis)
  args, specs = [q, k, v, g, beta], [tok] * 5
  if initial_state is not None:
    args.append(initial_state)
    specs.append(state)
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(row)
  has_h0, has_seg = initial_state is not None, segment_ids is not None

  def local(*a):
    h0 = a[5] if has_h0 else None
    seg = a[-1] if has_seg else None
    return kda_pallas(*a[:5], initial_state=h0, segment_ids=seg,
                      output_final_state=output_final_state, **kwargs)

  out_specs = (tok, state) if output_final_state else tok
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs,
                       check_vma=False)(*args)

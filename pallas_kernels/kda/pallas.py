"""Chunked KDA as Pallas kernels under one `jax.custom_vjp` (K3_SPEC 2.1): `prep` (per chunk:
decays, scores, UT transform) and `rec_fwd` (the state, per V block); backward `rec_bwd`,
`chunk_cots`, `chunk_bwd` (prep's hand-derived vjp). GPU: Triton, a program loops over the
chunks (Mosaic GPU would need the tile maths rewritten for warpgroups); TPU: Mosaic, chunks on
a sequential grid axis, state in VMEM. T pads to whole chunks, D to a power of two >= 16."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, chunk_kernels, spans
from pallas_kernels.kda.blocks import F32
from pallas_kernels.kda.chunk import check_sub_chunk, document_index
from pallas_kernels.platform import lowered_once, target_platform

# Tuned on the H200 (benchmarks/results/kda.md). block_v=None: the widest of BLOCKS_V
# giving MIN_PROGRAMS programs (wide blocks only pay while the GPU is full).
MIN_PROGRAMS = 256
BLOCKS_V = (64, 32, 16)
STATES_BLOCK_V, STATES_WARPS = 32, 2
SPAN_BLOCK_V, SPAN_PROGRAMS, MIN_SPAN_CHUNKS = 64, 256, 256
# chunk_bwd holds prep and its vjp: C = 32 spills registers, 64 overflows shared memory
GPU_CHUNK, GPU_MAX_CHUNK = 16, 32


def default_chunk(platform: str) -> int:
  """C when none is named: GPU_CHUNK on GPU, else 64 (the MXU's tiles)."""
  return GPU_CHUNK if platform == "gpu" else 64


def default_spans(platform, interpret, B, H, V, n_chunks):
  """Spans when none is named: 1, unless on GPU V blocks of 16 give <= MIN_PROGRAMS programs;
  then the most (a power of two) within SPAN_PROGRAMS at SPAN_BLOCK_V, MIN_SPAN_CHUNKS each."""
  if platform != "gpu" or interpret or B * H * max(1, V // 16) > MIN_PROGRAMS:
    return 1
  n = 1
  while (B * H * max(1, V // SPAN_BLOCK_V) * 2 * n <= SPAN_PROGRAMS
         and n_chunks >= 2 * n * MIN_SPAN_CHUNKS):
    n *= 2
  return n


@lowered_once(0, 8)
def _forward(cfg, q, k, v, g, beta, st0, masks, save_states):
  """(o, final state, `chunk_kernels.Prep`, chunk states or None, spans' transitions or
  None)."""
  prep = chunk_kernels.prep(cfg, q, k, v, g, beta, *masks)
  o, st, states, trans = spans.forward(cfg, *prep.recurrence, st0, q.dtype, save_states)
  return o, st, prep, states, trans


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  o, st, *_ = _forward(no_backward(cfg), q, k, v, g, beta, st0, (doc_c, doc_r, sees, last),
                       False)
  return o, st


def no_backward(cfg):
  """cfg for a forward that no backward follows: prep keeps nothing for `chunk_bwd`."""
  return dataclasses.replace(cfg, save_inverse=False)


def _core_fwd(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  forward_cfg = cfg if cfg.save_states else no_backward(cfg)  # else the backward runs prep
  o, st, prep, states, trans = _forward(forward_cfg, q, k, v, g, beta, st0,
                                        (doc_c, doc_r, sees, last), cfg.save_states)
  saved = (prep, states, trans) if cfg.save_states else None
  return (o, st), (q, k, v, g, beta, st0, doc_c, doc_r, sees, last, saved)


def _core_bwd(cfg, res, cots):
  *inputs, doc_c, doc_r, sees, last, saved = res
  masks = (doc_c, doc_r, sees, last)
  return (*_backward(cfg, inputs, masks, saved, cots), *mask_cotangents(masks))


@lowered_once(0)
def _backward(cfg, inputs, masks, saved, cots):
  """(dq, dk, dv, dg, dbeta, dst0) from the saved passes (or None: run them again)."""
  q, k, v, g, beta, st0 = inputs
  do, dst = cots
  if saved is None:
    prep = chunk_kernels.prep(cfg, q, k, v, g, beta, *masks)
    saved = (prep, *spans.forward(cfg, *prep.recurrence, st0, q.dtype, True)[2:])
  prep, states, trans = saved
  w, _, a, qs, ks, dec = prep.recurrence
  dvn, dstates, dst0 = spans.backward(cfg, w, a, qs, ks, dec, do, dst, trans)
  return (*input_cotangents(cfg, (q, k, v, g, beta), masks, prep, states, dstates, do, dvn),
          dst0)


def input_cotangents(cfg, inputs, masks, prep, states, dstates, do, dvn):
  """(dq, dk, dv, dg, dbeta) from the recurrence's backward (dstates, dvn); prep: `Prep`."""
  dw, da, dqs, dks, ddec = chunk_kernels.chunk_cots(cfg, prep.w, prep.u, states, dstates, do,
                                                    dvn)
  return chunk_kernels.chunk_bwd(cfg, *inputs, *masks, dw, dvn, da, dqs, dks, ddec,
                                 inverse=prep.inverse)


def mask_cotangents(masks):
  """The (zero) cotangents of `kernel_inputs`' document masks (doc_c, doc_r, sees, last)."""
  doc_c, doc_r, sees, last = masks
  zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return zero_int(doc_c), zero_int(doc_r), jnp.zeros_like(sees), jnp.zeros_like(last)


_kda_core.defvjp(_core_fwd, _core_bwd)


def kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
               output_final_state=False, chunk_size=None, sub_chunk_size=16, interpret=False,
               platform=None, block_v=None, save_states=True, bounded_gate=True, **tuning):
  """`kda_naive`'s contract, any T; bf16 inputs take bf16 matmul operands (fp32 state and
  decays). chunk_size: a power of two >= 16, <= GPU_MAX_CHUNK on GPU; save_states=False
  recomputes in the backward; bounded_gate: g >= LOWER_BOUND; tuning: `blocks.Config`."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  cfg, args = kernel_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            segment_ids=segment_ids, chunk_size=chunk_size,
                            sub_chunk_size=sub_chunk_size, interpret=interpret,
                            platform=platform, block_v=block_v, save_states=save_states,
                            bounded_gate=bounded_gate, **tuning)
  o, st = _kda_core(cfg, *args)
  if blocks.heads_major(cfg.platform):
    o = jnp.swapaxes(o, 1, 2)
  o = o[:, :T, :, :V]
  if not output_final_state:
    return o
  return o, jnp.swapaxes(st, -1, -2)[:, :, :K, :V]


def kernel_inputs(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size,
                  sub_chunk_size, interpret, platform, block_v, save_states,
                  bounded_gate=True, **tuning):
  """(Config, padded inputs in the kernels' layout; the initial state as [B, H, Vp, Kp])."""
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
  if bounded_gate:
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
               save_states=save_states, bounded_gate=bounded_gate, spans=n_spans, **tuning)
  pad_t = -T % (C * n_spans)
  Tp, N = T + pad_t, (T + pad_t) // C
  bv = min(block_v, Vp)
  if Vp % bv:
    raise ValueError(f"block_v={block_v} does not divide the padded V={Vp}")

  def layout(x, d_pad):
    x = jnp.pad(x, [(0, 0), (0, pad_t), (0, 0), (0, d_pad)])
    return jnp.swapaxes(x, 1, 2) if blocks.heads_major(platform) else x

  dt = q.dtype
  qh, kh = (layout(x.astype(dt), Kp - K) for x in (q, k))
  vh = layout(v.astype(dt), Vp - V)
  # g and beta keep their dtype: an fp32 gate's sums set the decays
  gh = layout(g, Kp - K)
  bh = layout(beta[..., None], 0)

  doc = document_index(segment_ids, B, T)
  doc = jnp.pad(doc, [(0, 0), (0, pad_t)], mode="edge")
  chunked = doc.reshape(B, N, C)
  doc_state = jnp.concatenate([chunked[:, :1, 0], chunked[:, :-1, -1]], axis=1)
  sees = (chunked == doc_state[..., None]).astype(F32).reshape(B, Tp, 1)
  last = (chunked == chunked[..., -1:]).astype(F32).reshape(B, Tp, 1)
  doc_c, doc_r = doc[..., None], chunked[:, :, None, :]

  if initial_state is None:
    st0 = jnp.zeros((B, H, Vp, Kp), F32)
  else:
    st0 = jnp.swapaxes(jnp.asarray(initial_state, F32), -1, -2)
    st0 = jnp.pad(st0, [(0, 0), (0, 0), (0, Vp - V), (0, Kp - K)])
  return cfg, (qh, kh, vh, gh, bh, st0, doc_c, doc_r, sees, last)


def kda_pallas_sharded(q, k, v, g, beta, *, mesh, batch_axis=None, head_axis=None,
                       initial_state=None, segment_ids=None, output_final_state=False,
                       **kwargs):
  """`kda_pallas` per device under `jax.shard_map` over batch_axis and head_axis."""
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

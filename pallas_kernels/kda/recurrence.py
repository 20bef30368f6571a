"""KDA's inter-chunk recurrence, `rec_fwd` and `rec_bwd`: a program per (b, h, span and V
block) loops over its span's chunks (GPU, interpret), or the chunks are a sequential grid
axis (TPU, one span). States are kept transposed, [BV, K]. Overview: `pallas.py`."""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, tile
from pallas_kernels.kda.blocks import F32


def v_new(cfg, w, u, st):
  return u.astype(F32) - tile.dot(w, st, "nt", cfg.precision, cfg.mm)


def next_state(cfg, st, dec, vn, ks):
  return st * dec + tile.dot(vn, ks, "tn", cfg.precision, cfg.mm)


def _fwd_step(cfg, w, u, a, qs, ks, dec, st):
  mm, prec = cfg.mm, cfg.precision
  vn = v_new(cfg, w, u, st)
  o = tile.dot(qs, st, "nt", prec, mm) + tile.dot(a, vn, "nn", prec, mm)
  return o, next_state(cfg, st, dec, vn, ks)


def _rec_fwd_kernel(w_ref, u_ref, a_ref, qs_ref, ks_ref, dec_ref, st0_ref, o_ref, st_ref,
                    *states_ref, cfg, n_chunks):
  C = cfg.chunk

  def body(n, st):
    rows = pl.ds(pl.multiple_of(n * C, C), C)
    if states_ref:
      states_ref[0][n] = st.astype(states_ref[0].dtype)
    o, st = _fwd_step(cfg, w_ref[rows, :], u_ref[rows, :], a_ref[rows, :], qs_ref[rows, :],
                      ks_ref[rows, :], dec_ref[n], st)
    o_ref[rows, :] = o.astype(o_ref.dtype)
    return st

  st_ref[...] = lax.fori_loop(0, n_chunks, body, st0_ref[...].astype(F32))


def _rec_fwd_kernel_tpu(w_ref, u_ref, a_ref, qs_ref, ks_ref, dec_ref, st0_ref, o_ref, st_ref,
                        *rest, cfg, n_chunks):
  *states_ref, scratch = rest
  n = pl.program_id(3)

  @pl.when(n == 0)
  def _():
    scratch[...] = st0_ref[...].astype(F32)

  st = scratch[...]
  if states_ref:
    states_ref[0][...] = st.astype(states_ref[0].dtype)
  o, st = _fwd_step(cfg, w_ref[...], u_ref[...], a_ref[...], qs_ref[...], ks_ref[...],
                    dec_ref[...], st)
  o_ref[...] = o.astype(o_ref.dtype)
  scratch[...] = st

  @pl.when(n == n_chunks - 1)
  def _():
    st_ref[...] = st


def _sizes(cfg, w, V, dec, states=False):
  """(B, H, Tp, K, N, BV); on TPU BV is lane-dense: all of V or 128."""
  B, H, Tp, K = blocks.dims(cfg, w)
  bv = cfg.states_block_v if states and cfg.states_block_v else cfg.block_v
  BV = (V if V <= 128 else 128) if cfg.platform == "tpu" else min(bv, V)
  return B, H, Tp, K, dec.shape[2], BV


def _span_specs(cfg, Tp, N, K, V, BV):
  """Grid (B, H, S x V blocks) and specs (tokens, V block, decays, chunk states, span state).
  One span keeps indices (b, h, V block): a folded span index slows the Triton program."""
  S, nv = cfg.spans, V // BV
  at = (lambda j: (j // nv, j % nv)) if S > 1 else (lambda j: (0, j))  # (span, V block)
  tok = lambda d: blocks.tokens(cfg, Tp // S, d, lambda b, h, j: (b, h, at(j)[0], 0))
  vblk = blocks.tokens(cfg, Tp // S, BV, lambda b, h, j: (b, h, *at(j)))
  dec = pl.BlockSpec((None, None, N // S, 1, K), lambda b, h, j: (b, h, at(j)[0], 0, 0))
  chunk_states = pl.BlockSpec((None, None, N // S, BV, K),
                              lambda b, h, j: (b, h, *at(j), 0))
  state = pl.BlockSpec((None, None, None, BV, K), lambda b, h, j: (b, h, *at(j), 0))
  return S * nv, (tok, vblk, dec, chunk_states, state)


def _tpu_params():
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  return pltpu, pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def rec_fwd(cfg, w, u, a, qs, ks, dec, st0, out_dtype, save_states):
  """From prep's outputs and st0 [B, H, S, V, K] fp32 entering each span: o (kernels'
  layout), the state leaving each span, and if save_states each chunk's entering state
  [B, H, N, V, K] in the operand dtype."""
  V, C, S = u.shape[-1], cfg.chunk, cfg.spans
  B, H, Tp, K, N, BV = _sizes(cfg, w, V, dec, save_states)
  out_shape = [jax.ShapeDtypeStruct(blocks.token_shape(cfg, B, H, Tp, V), out_dtype),
               jax.ShapeDtypeStruct((B, H, S, V, K), F32)]
  if save_states:
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, V, K), cfg.mm))
  args = (w, u, a, qs, ks, dec, st0)
  if cfg.platform == "tpu":
    tok = lambda d: blocks.tokens(cfg, C, d, lambda b, h, i, n: (b, h, n, 0))
    vblk = blocks.tokens(cfg, C, BV, lambda b, h, i, n: (b, h, n, i))
    state = pl.BlockSpec((None, None, None, BV, K), lambda b, h, i, n: (b, h, 0, i, 0))
    out_specs = [vblk, state]
    if save_states:
      out_specs.append(pl.BlockSpec((None, None, None, BV, K),
                                    lambda b, h, i, n: (b, h, n, i, 0)))
    pltpu, params = _tpu_params()
    return pl.pallas_call(
        functools.partial(_rec_fwd_kernel_tpu, cfg=cfg, n_chunks=N),
        grid=(B, H, V // BV, N),
        in_specs=[tok(K), vblk, tok(C), tok(K), tok(K),
                  pl.BlockSpec((None, None, None, 1, K), lambda b, h, i, n: (b, h, n, 0, 0)),
                  state],
        out_specs=out_specs, out_shape=out_shape, compiler_params=params,
        scratch_shapes=[pltpu.VMEM((BV, K), F32)], interpret=cfg.interpret)(*args)
  programs, (tok, vblk, dec_spec, chunk_states, state) = _span_specs(cfg, Tp, N, K, V, BV)
  out_specs = [vblk, state] + ([chunk_states] if save_states else [])
  return blocks.call(
      cfg, functools.partial(_rec_fwd_kernel, cfg=cfg, n_chunks=N // S),
      grid=(B, H, programs), in_specs=[tok(K), vblk, tok(C), tok(K), tok(K), dec_spec, state],
      out_specs=out_specs, out_shape=out_shape, num_stages=cfg.rec_stages,
      num_warps=(cfg.states_warps or cfg.rec_warps) if save_states else cfg.rec_warps)(*args)


def _rec_bwd_step(cfg, w, a, qs, ks, dec, do, dst):
  """(dv_new [C, BV], d state entering) from the leaving state's cotangent dst [BV, K]."""
  mm, prec = cfg.mm, cfg.precision
  dvn = tile.dot(a, do, "tn", prec, mm) + tile.dot(ks, dst, "nt", prec, mm)
  dst = dst * dec + tile.dot(do, qs, "tn", prec, mm) - tile.dot(dvn, w, "tn", prec, mm)
  return dvn, dst


def _rec_bwd_kernel(w_ref, a_ref, qs_ref, ks_ref, dec_ref, do_ref, dst_ref, *out_refs, cfg,
                    n_chunks):
  """out_refs: (dvn, chunk states' cotangents, dst0), or dst0 alone (transition=True)."""
  C = cfg.chunk
  *cots_refs, dst0_ref = out_refs

  def body(i, dst):
    n = n_chunks - 1 - i
    rows = pl.ds(pl.multiple_of(n * C, C), C)
    if cots_refs:
      cots_refs[1][n] = dst.astype(cots_refs[1].dtype)
    dvn, dst = _rec_bwd_step(cfg, w_ref[rows, :], a_ref[rows, :], qs_ref[rows, :],
                             ks_ref[rows, :], dec_ref[n], do_ref[rows, :], dst)
    if cots_refs:
      cots_refs[0][rows, :] = dvn
    return dst

  dst0_ref[...] = lax.fori_loop(0, n_chunks, body, dst_ref[...].astype(F32))


def _rec_bwd_kernel_tpu(w_ref, a_ref, qs_ref, ks_ref, dec_ref, do_ref, dst_ref, dvn_ref,
                        dsts_ref, dst0_ref, scratch, *, cfg, n_chunks):
  n = pl.program_id(3)

  @pl.when(n == 0)
  def _():
    scratch[...] = dst_ref[...].astype(F32)

  dst = scratch[...]
  dsts_ref[...] = dst.astype(dsts_ref.dtype)
  dvn, dst = _rec_bwd_step(cfg, w_ref[...], a_ref[...], qs_ref[...], ks_ref[...],
                           dec_ref[...], do_ref[...], dst)
  dvn_ref[...] = dvn
  scratch[...] = dst

  @pl.when(n == n_chunks - 1)
  def _():
    dst0_ref[...] = dst


def rec_bwd(cfg, w, a, qs, ks, dec, do, dst, transition=False):
  """From do and dst [B, H, S, V, K] (leaving each span): dv_new fp32, the cotangents of
  each chunk's leaving state [B, H, N, V, K] and of each span's entering one (transition:
  the last alone)."""
  V, C, S = do.shape[-1], cfg.chunk, cfg.spans
  B, H, Tp, K, N, BV = _sizes(cfg, w, V, dec)
  span_state = jax.ShapeDtypeStruct((B, H, S, V, K), F32)
  out_shape = [jax.ShapeDtypeStruct(blocks.token_shape(cfg, B, H, Tp, V), F32),
               jax.ShapeDtypeStruct((B, H, N, V, K), cfg.mm), span_state]
  args = (w, a, qs, ks, dec, do, dst)
  if cfg.platform == "tpu":
    r = lambda n: N - 1 - n  # chunks in reverse
    tok = lambda d: blocks.tokens(cfg, C, d, lambda b, h, i, n: (b, h, r(n), 0))
    vblk = blocks.tokens(cfg, C, BV, lambda b, h, i, n: (b, h, r(n), i))
    state = pl.BlockSpec((None, None, None, BV, K), lambda b, h, i, n: (b, h, 0, i, 0))
    pltpu, params = _tpu_params()
    return pl.pallas_call(
        functools.partial(_rec_bwd_kernel_tpu, cfg=cfg, n_chunks=N),
        grid=(B, H, V // BV, N),
        in_specs=[tok(K), tok(C), tok(K), tok(K),
                  pl.BlockSpec((None, None, None, 1, K), lambda b, h, i, n: (b, h, r(n), 0, 0)),
                  vblk, state],
        out_specs=[vblk, pl.BlockSpec((None, None, None, BV, K),
                                      lambda b, h, i, n: (b, h, r(n), i, 0)), state],
        out_shape=out_shape, compiler_params=params,
        scratch_shapes=[pltpu.VMEM((BV, K), F32)], interpret=cfg.interpret)(*args)
  programs, (tok, vblk, dec_spec, chunk_states, state) = _span_specs(cfg, Tp, N, K, V, BV)
  out_specs = [vblk, chunk_states, state]
  if transition:
    out_specs, out_shape = out_specs[-1:], out_shape[-1:]
  outs = blocks.call(
      cfg, functools.partial(_rec_bwd_kernel, cfg=cfg, n_chunks=N // S),
      grid=(B, H, programs),
      in_specs=[tok(K), tok(C), tok(K), tok(K), dec_spec, vblk, state],
      out_specs=out_specs, out_shape=out_shape, num_warps=cfg.rec_warps,
      num_stages=cfg.rec_stages)(*args)
  return outs[0] if transition else outs

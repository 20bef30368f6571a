"""KDA's recurrences in `cfg.spans` parallel spans, for few rows and heads (GPU, interpret).
The chunk step is affine in the transposed state, st' = st * dec + (u - w st^T)^T k_s, so a
span maps st_out = st_in P^T + R^T. Forward: `transitions` (every span's [K + V, K] (P^T; R^T)
at once, stepped from st = I with u = 0 and from st = 0), `chain` (the spans in order: each
one's entering state), `rec_fwd` (every span at once). The backward mirrors it in reverse.
P and R take the state's bf16 products (the carry stays fp32); the chain runs in fp32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, recurrence, tile
from pallas_kernels.kda.blocks import F32



def forward(cfg, w, u, a, qs, ks, dec, st0, out_dtype, save_states, t=None):
  """(o, final state, chunk states or None, transitions or None) from st0 [B, H, V, K];
  t: `transitions` if already taken."""
  if cfg.spans == 1:
    o, st, *states = recurrence.rec_fwd(cfg, w, u, a, qs, ks, dec, st0[:, :, None],
                                        out_dtype, save_states)
    return o, st[:, :, 0], (states[0] if save_states else None), t
  if t is None:
    t = transitions(cfg, w, u, ks, dec)
  entering, st = chain(cfg, t, t, st0, reverse=False)
  o, _, *states = recurrence.rec_fwd(cfg, w, u, a, qs, ks, dec, entering, out_dtype,
                                     save_states)
  return o, st, (states[0] if save_states else None), t


def backward(cfg, w, a, qs, ks, dec, do, dst, t, own=None):
  """(dv_new, chunk states' cotangents, dst0) from do, dst [B, H, V, K] and `forward`'s t;
  own: `own_cotangents` if already taken."""
  if cfg.spans == 1:
    dvn, dstates, dst0 = recurrence.rec_bwd(cfg, w, a, qs, ks, dec, do, dst[:, :, None])
    return dvn, dstates, dst0[:, :, 0]
  if own is None:
    own = own_cotangents(cfg, w, a, qs, ks, dec, do)
  leaving, dst0 = chain(cfg, t, own, dst, reverse=True)
  dvn, dstates, _ = recurrence.rec_bwd(cfg, w, a, qs, ks, dec, do, leaving)
  return dvn, dstates, dst0


def own_cotangents(cfg, w, a, qs, ks, dec, do):
  """[B, H, S, V, K]: each span's entering state's cotangent from its own outputs alone."""
  B, H, _, K = blocks.dims(cfg, w)
  V = do.shape[-1]
  return recurrence.rec_bwd(cfg, w, a, qs, ks, dec, do,
                            jnp.zeros((B, H, cfg.spans, V, K), F32), transition=True)


def _transition_kernel(w_ref, u_ref, ks_ref, dec_ref, t_ref, *, cfg, n_chunks, p_blocks):
  """A program per (b, h, row block, span): rows of P^T (from I, u = 0) or R^T (from 0)."""
  C = cfg.chunk
  i = pl.program_id(2)
  BV, K = t_ref.shape
  is_p = i < p_blocks
  row = lax.broadcasted_iota(jnp.int32, (BV, K), 0) + i * BV
  col = lax.broadcasted_iota(jnp.int32, (BV, K), 1)
  st = ((row == col) & is_p).astype(F32)

  def body(n, st):
    rows = pl.ds(pl.multiple_of(n * C, C), C)
    u = jnp.where(is_p, 0.0, u_ref[rows, :].astype(F32))
    vn = recurrence.v_new(cfg, w_ref[rows, :], u, st)
    return recurrence.next_state(cfg, st, dec_ref[n], vn, ks_ref[rows, :])

  t_ref[...] = lax.fori_loop(0, n_chunks, body, st)


def transitions(cfg, w, u, ks, dec):
  """[B, H, S, K + V, K] fp32: each span's P^T (rows :K) and R^T (rows K:)."""
  V, S = u.shape[-1], cfg.spans
  B, H, Tp, K = blocks.dims(cfg, w)
  N = dec.shape[2]
  BV = min(cfg.transition_block, K, V)
  p_blocks = K // BV
  tok = lambda d: blocks.tokens(cfg, Tp // S, d, lambda b, h, i, s: (b, h, s, 0))
  u_blk = blocks.tokens(cfg, Tp // S, BV,
                        lambda b, h, i, s: (b, h, s, jnp.maximum(i - p_blocks, 0)))
  return blocks.call(
      cfg, functools.partial(_transition_kernel, cfg=cfg, n_chunks=N // S, p_blocks=p_blocks),
      grid=(B, H, (K + V) // BV, S),
      in_specs=[tok(K), u_blk, tok(K),
                pl.BlockSpec((None, None, N // S, 1, K), lambda b, h, i, s: (b, h, s, 0, 0))],
      out_specs=pl.BlockSpec((None, None, None, BV, K), lambda b, h, i, s: (b, h, s, i, 0)),
      out_shape=jax.ShapeDtypeStruct((B, H, S, K + V, K), F32),
      num_warps=cfg.rec_warps, num_stages=cfg.rec_stages)(w, u, ks, dec)


def _chain_kernel(p_ref, r_ref, st0_ref, states_ref, st_ref, *, cfg, n_spans, reverse):
  """Forward st <- st P_s^T + R_s^T; reverse dst <- dst P_s + E_s from the last span."""
  prec = cfg.precision

  def body(i, st):
    s = n_spans - 1 - i if reverse else i
    states_ref[s] = st
    return tile.dot(st, p_ref[s], "nt" if reverse else "nn", prec) + r_ref[s]

  st_ref[...] = lax.fori_loop(0, n_spans, body, st0_ref[...])


def chain(cfg, t, r, st0, *, reverse):
  """(state entering each span [B, H, S, V, K], final state) from t, the inhomogeneous parts
  r (forward: t's rows K:; reverse: each span's own cotangent) and st0 [B, H, V, K]."""
  B, H, S, _, K = t.shape
  V = st0.shape[2]
  BV = min(cfg.chain_block, V, K)
  r_offset = 0 if reverse else K // BV
  span_states = pl.BlockSpec((None, None, S, BV, K), lambda b, h, i: (b, h, 0, i, 0))
  return blocks.call(
      cfg, functools.partial(_chain_kernel, cfg=cfg, n_spans=S, reverse=reverse),
      grid=(B, H, V // BV),
      in_specs=[pl.BlockSpec((None, None, S, K, K), lambda b, h, i: (b, h, 0, 0, 0)),
                pl.BlockSpec((None, None, S, BV, K),
                             lambda b, h, i: (b, h, 0, i + r_offset, 0)),
                pl.BlockSpec((None, None, BV, K), lambda b, h, i: (b, h, i, 0))],
      out_specs=[span_states, pl.BlockSpec((None, None, BV, K), lambda b, h, i: (b, h, i, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, H, S, V, K), F32),
                 jax.ShapeDtypeStruct((B, H, V, K), F32)],
      num_warps=cfg.rec_warps)(t, r, st0)

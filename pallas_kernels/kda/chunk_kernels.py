"""KDA's per-chunk kernels, grid (B, H, N): `prep`, `chunk_cots`, `chunk_bwd` (`pallas.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, tile
from pallas_kernels.kda.blocks import F32


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, docc_ref, docr_ref, sees_ref, last_ref,
                 w_ref, u_ref, a_ref, qs_ref, ks_ref, dec_ref, *, cfg):
  w, u, a, qs, ks, dec = tile.chunk_prep(
      q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...], docc_ref[...],
      docr_ref[...], sees_ref[...], last_ref[...], scale=cfg.scale, sub=cfg.sub,
      mm_dtype=cfg.mm, precision=cfg.prep_prec, bounded=cfg.bounded_gate)
  for ref, x in ((w_ref, w), (u_ref, u), (a_ref, a), (qs_ref, qs), (ks_ref, ks),
                 (dec_ref, dec)):
    ref[...] = x.astype(ref.dtype)


def _prep_dtypes(cfg):
  """(w, u, A_qk, q_s, k_s, dec): matmul operands in mm, u and dec (fp32 arithmetic) fp32."""
  mm = cfg.mm
  return mm, F32, mm, mm, mm, F32


def prep(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last):
  """`pallas.kernel_inputs` -> w, q_s, k_s (K columns), u (V), A_qk (C), dec [B, H, N, 1, K]."""
  B, H, Tp, K = blocks.dims(cfg, q)
  V = v.shape[-1]
  C = cfg.chunk
  N = Tp // C
  tok, col, row, per_chunk = blocks.chunk_specs(cfg, K)
  dtypes = _prep_dtypes(cfg)
  out_shape = [jax.ShapeDtypeStruct(blocks.token_shape(cfg, B, H, Tp, d), dt)
               for d, dt in zip((K, V, C, K, K), dtypes)]
  out_shape.append(jax.ShapeDtypeStruct((B, H, N, 1, K), F32))
  return blocks.call(
      cfg, functools.partial(_prep_kernel, cfg=cfg), grid=(B, H, N),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col],
      out_specs=[tok(K), tok(V), tok(C), tok(K), tok(K), per_chunk],
      out_shape=out_shape, num_warps=cfg.prep_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last)


def _chunk_cots_kernel(w_ref, u_ref, st_ref, dst_ref, do_ref, dvn_ref, dw_ref, da_ref,
                       dqs_ref, dks_ref, ddec_ref, *, cfg):
  mm, prec = cfg.mm, cfg.precision
  st, dst = st_ref[...], dst_ref[...]
  do, dvn = do_ref[...], dvn_ref[...]
  v_new = u_ref[...] - tile.dot(w_ref[...], st, "nt", prec, mm)
  dw_ref[...] = -tile.dot(dvn, st, "nn", prec, mm)
  da_ref[...] = tile.dot(do, v_new, "nt", prec, mm)
  dqs_ref[...] = tile.dot(do, st, "nn", prec, mm)
  dks_ref[...] = tile.dot(v_new, dst, "nn", prec, mm)
  ddec_ref[...] = jnp.sum(st.astype(F32) * dst.astype(F32), axis=0, keepdims=True)


def chunk_cots(cfg, w, u, states, dstates, do, dvn):
  """fp32 dw, dA_qk, dq_s, dk_s, ddec from do, dvn and the states around each chunk. Apart
  from `chunk_bwd`: one kernel holding the [V, K] states too runs out of registers."""
  B, H, Tp, K = blocks.dims(cfg, w)
  C, N, V = cfg.chunk, states.shape[2], u.shape[-1]
  tok, _, _, per_chunk = blocks.chunk_specs(cfg, K)
  state = pl.BlockSpec((None, None, None, V, K), lambda b, h, n: (b, h, n, 0, 0))
  out_shape = [jax.ShapeDtypeStruct(blocks.token_shape(cfg, B, H, Tp, d), F32)
               for d in (K, C, K, K)]
  out_shape.append(jax.ShapeDtypeStruct((B, H, N, 1, K), F32))
  return blocks.call(
      cfg, functools.partial(_chunk_cots_kernel, cfg=cfg), grid=(B, H, N),
      in_specs=[tok(K), tok(V), state, state, tok(V), tok(V)],
      out_specs=[tok(K), tok(C), tok(K), tok(K), per_chunk],
      out_shape=out_shape, num_warps=cfg.cots_warps,
  )(w, u, states, dstates, do, dvn)


def _chunk_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, docc_ref, docr_ref, sees_ref,
                      last_ref, dw_ref, du_ref, da_ref, dqs_ref, dks_ref, ddec_ref, dq_ref,
                      dk_ref, dv_ref, dg_ref, dbeta_ref, *, cfg):
  _, vjp = tile.chunk_prep_vjp(
      q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...], docc_ref[...],
      docr_ref[...], sees_ref[...], last_ref[...], scale=cfg.scale, sub=cfg.sub,
      mm_dtype=cfg.mm, precision=cfg.bwd_prec, bounded=cfg.bounded_gate)
  grads = vjp(dw_ref[...], du_ref[...], da_ref[...], dqs_ref[...], dks_ref[...],
              ddec_ref[...])
  for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref), grads):
    ref[...] = x.astype(ref.dtype)


def chunk_bwd(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec):
  """dq, dk, dv, dg, dbeta from prep's output cotangents (du: v_new's), `tile.chunk_prep_vjp`."""
  C, K, V = cfg.chunk, q.shape[-1], v.shape[-1]
  tok, col, row, per_chunk = blocks.chunk_specs(cfg, K)
  B, H, Tp, _ = blocks.dims(cfg, q)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta)]
  return blocks.call(
      cfg, functools.partial(_chunk_bwd_kernel, cfg=cfg), grid=(B, H, Tp // C),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col,
                tok(K), tok(V), tok(C), tok(K), tok(K), per_chunk],
      out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1)],
      out_shape=out_shape, num_warps=cfg.bwd_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec)

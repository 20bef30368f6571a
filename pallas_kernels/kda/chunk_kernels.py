"""KDA's per-chunk kernels, grid (B, H, N): `prep`, `chunk_cots`, `chunk_bwd` (`pallas.py`)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import blocks, tile
from pallas_kernels.kda.blocks import F32


class Prep(NamedTuple):
  """`prep`'s outputs: the recurrence's operands w, q_s, k_s [.., K], u [.., V], A_qk [.., C],
  dec [B, H, N, 1, K]; with `Config.save_inverse` also `chunk_bwd`'s (I + A_kk)^-1 and
  s_kk [.., C] (fp32), else None."""
  w: jax.Array
  u: jax.Array
  a: jax.Array
  qs: jax.Array
  ks: jax.Array
  dec: jax.Array
  inv: jax.Array | None = None
  s_kk: jax.Array | None = None

  @property
  def recurrence(self):
    """(w, u, A_qk, q_s, k_s, dec): what `spans.forward` and `spans.backward` take."""
    return tuple(self[:6])

  @property
  def inverse(self):
    """(inv, s_kk) for `chunk_bwd`, or None."""
    return None if self.inv is None else (self.inv, self.s_kk)


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, docc_ref, docr_ref, sees_ref, last_ref,
                 *out_refs, cfg):
  outs = tile.chunk_prep(
      q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...], docc_ref[...],
      docr_ref[...], sees_ref[...], last_ref[...], scale=cfg.scale, sub=cfg.sub,
      mm_dtype=cfg.mm, precision=cfg.prep_prec, bounded=cfg.bounded_gate,
      with_inverse=cfg.save_inverse)
  for ref, x in zip(out_refs, outs):
    ref[...] = x.astype(ref.dtype)


def prep(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last) -> Prep:
  """`pallas.kernel_inputs` -> `Prep`, a chunk per program: matmul operands in mm, u (fp32
  arithmetic), dec, inv and s_kk in fp32."""
  B, H, Tp, K = blocks.dims(cfg, q)
  V = v.shape[-1]
  C, mm = cfg.chunk, cfg.mm
  N = Tp // C
  tok, col, row, per_chunk = blocks.chunk_specs(cfg, K)
  token = lambda d, dt: (tok(d), jax.ShapeDtypeStruct(blocks.token_shape(cfg, B, H, Tp, d), dt))
  outs = [token(K, mm), token(V, F32), token(C, mm), token(K, mm), token(K, mm),
          (per_chunk, jax.ShapeDtypeStruct((B, H, N, 1, K), F32))]   # in `Prep`'s order
  if cfg.save_inverse:
    outs += [token(C, F32), token(C, F32)]
  out_specs, out_shape = zip(*outs)
  return Prep(*blocks.call(
      cfg, functools.partial(_prep_kernel, cfg=cfg), grid=(B, H, N),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col],
      out_specs=list(out_specs), out_shape=list(out_shape), num_warps=cfg.prep_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last))


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
                      last_ref, dw_ref, du_ref, da_ref, dqs_ref, dks_ref, ddec_ref, *refs, cfg):
  inverse = (refs[0][...], refs[1][...]) if cfg.save_inverse else None
  _, vjp = tile.chunk_prep_vjp(
      q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...], docc_ref[...],
      docr_ref[...], sees_ref[...], last_ref[...], scale=cfg.scale, sub=cfg.sub,
      mm_dtype=cfg.mm, precision=cfg.bwd_prec, bounded=cfg.bounded_gate, inverse=inverse)
  grads = vjp(dw_ref[...], du_ref[...], da_ref[...], dqs_ref[...], dks_ref[...],
              ddec_ref[...])
  for ref, x in zip(refs[-5:], grads):
    ref[...] = x.astype(ref.dtype)


def chunk_bwd(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec,
              inverse=None):
  """dq, dk, dv, dg, dbeta from prep's output cotangents (du: v_new's), `tile.chunk_prep_vjp`;
  inverse: `Prep.inverse`, required under `Config.save_inverse`."""
  if cfg.save_inverse != (inverse is not None):
    raise ValueError(f"chunk_bwd: Config.save_inverse={cfg.save_inverse} takes inverse="
                     f"{'Prep.inverse' if cfg.save_inverse else 'None'}")
  C, K, V = cfg.chunk, q.shape[-1], v.shape[-1]
  tok, col, row, per_chunk = blocks.chunk_specs(cfg, K)
  B, H, Tp, _ = blocks.dims(cfg, q)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta)]
  return blocks.call(
      cfg, functools.partial(_chunk_bwd_kernel, cfg=cfg), grid=(B, H, Tp // C),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col,
                tok(K), tok(V), tok(C), tok(K), tok(K), per_chunk]
      + [tok(C)] * (2 if inverse else 0),
      out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1)],
      out_shape=out_shape, num_warps=cfg.bwd_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec, *(inverse or ()))

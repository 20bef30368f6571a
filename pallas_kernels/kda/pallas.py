"""Chunked Kimi Delta Attention as Pallas kernels, forward and backward (K3_SPEC 2.1).

Five kernels, one `jax.custom_vjp`:
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
The forward's prep outputs (w, A_qk, q_s, k_s, decay) and chunk states are the residuals
(`save_states=False`: recomputed in the backward instead). Columns of V are independent in
the delta rule, so V blocks parallelize the recurrences at no extra work.

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

Speed (H200, 2026-12-01, benchmarks/results/kda.md, session 10): chunks of 16 (one diagonal
tile) are fastest on the GPU; at (8, 4096, 16, 128) forward 1.31 ms (fla 1.54), forward +
backward 7.34 ms (fla 7.37), of which chunk_bwd 3.6 ms (bound by its chain of small
dependent tile products, not by bandwidth or FLOPs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import tile

F32 = jnp.float32
LOWER_BOUND = -5.0
# block_v=None: the widest V block of 64, 32 or 16 that gives the recurrences this many
# programs, else 16. H200, chunk 16 (results/kda.md, session 10), rec_fwd / rec_bwd in ms:
# (8, 4096, 16, 128) 0.88 / 0.65 at 64 (256 programs), 1.17 / 1.10 at 32; (1, 32768, 16, 128)
# 4.05 / 3.09 at 64, 3.07 / 2.05 at 32, 2.72 / 1.85 at 16.
MIN_PROGRAMS = 256
BLOCKS_V = (64, 32, 16)
# The GPU kernels' chunk lengths (H200, results/kda.md, session 7): chunk_bwd holds a chunk's
# prep and its vjp at once; at C = 32 it runs 5x slower than at 16 (register spills), at 64
# Triton asks for 320 KiB of shared memory, over the H200's 227 KiB.
GPU_CHUNK, GPU_MAX_CHUNK = 16, 32


def default_chunk(platform: str) -> int:
  """The kernels' chunk length when none is named: GPU_CHUNK on GPU, else 64 (TPU's MXU
  tiles)."""
  return GPU_CHUNK if platform == "gpu" else 64
_MAX_EXPONENT = 80.0


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one call (hashable: a custom_vjp non-differentiable argument)."""
  scale: float
  chunk: int  # C
  sub: int  # diagonal sub-tile length L
  block_v: int  # BV
  mm_dtype: str  # operand dtype of the big matmuls: "bfloat16" or "float32"
  interpret: bool
  platform: str  # "gpu", "tpu" or "cpu" (interpret)
  save_states: bool = True  # False: the backward reruns rec_fwd for the chunk states
  prep_warps: int = 4  # measured on the H200: 4 warps twice as fast as 8
  # GPU fp32 matmuls of prep ("tf32x3", "tf32" or "ieee"). H200 (8, 4096, 16, 128), chunk 16,
  # fp32 gate: prep 0.80 ms at tf32, 1.24 at tf32x3; errors against the fp32 reference equal
  # to two digits at chunks 16 and 32 (results/kda.md, session 9)
  prep_precision: str = "tf32"
  # Triton pipelining stages of the recurrences' chunk loop (the next chunk's loads overlap
  # this one's products). H200, rec_bwd at (1, 32768, 16, 128): 3.99 ms at 1, 2.15 at 3
  rec_stages: int = 3
  rec_warps: int = 4  # the recurrences' warps per program (GPU)
  # chunk_cots (GPU). H200, (8, 4096, 16, 128): 1.38 ms at 4 warps, 1.89 at 8, though at 4
  # it spills 184 bytes a thread (kernel_resources.py)
  cots_warps: int = 4
  # chunk_bwd, H200 (8, 4096, 16, 128), with chunk_cots' work inside it: 6.1 ms at 8 warps,
  # 14.2 at 4, 30.5 at 16
  bwd_warps: int = 8
  # chunk_bwd's fp32 matmuls (prep recomputed, its vjp). H200 (8, 4096, 16, 128), 8 warps:
  # 5.33 ms at tf32, 6.32 at tf32x3, 8.87 at ieee; gradients as accurate (session 9)
  bwd_precision: str = "tf32"

  @property
  def precision(self):
    """Precision of float32 matmuls: 3-pass TF32 on GPU tensor cores, else full fp32."""
    return self._gpu_precision("tf32x3")

  @property
  def prep_prec(self):
    """Precision of the prep kernel's float32 matmuls (tunable on GPU)."""
    return self._gpu_precision(self.prep_precision)

  @property
  def bwd_prec(self):
    """Precision of chunk_bwd's float32 matmuls (prep recomputed and its vjp)."""
    return self._gpu_precision(self.bwd_precision)

  def _gpu_precision(self, name):
    """The named GPU algorithm ("tf32x3", "tf32", "ieee") on GPU; HIGHEST elsewhere."""
    if self.platform == "gpu" and not self.interpret:
      return {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
              "ieee": lax.DotAlgorithmPreset.F32_F32_F32}[name]
    return lax.Precision.HIGHEST

  @property
  def mm(self):
    return jnp.dtype(self.mm_dtype)


def _call(cfg, kernel, **kw):
  if cfg.platform == "tpu" and not cfg.interpret:
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    n = len(kw["grid"])
    kw["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel",) * n)
    kw.pop("num_warps", None)
  elif cfg.platform == "gpu" and not cfg.interpret:
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    kw["compiler_params"] = plgpu.CompilerParams(num_warps=kw.pop("num_warps", 4),
                                                 num_stages=kw.pop("num_stages", 1))
  else:
    kw.pop("num_warps", None)
  kw.pop("num_stages", None)
  return pl.pallas_call(kernel, interpret=cfg.interpret, **kw)


# ------------------------------------------------------------------------------------- prep


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, docc_ref, docr_ref, sees_ref, last_ref,
                 w_ref, u_ref, a_ref, qs_ref, ks_ref, dec_ref, *, cfg):
  w, u, a, qs, ks, dec = tile.chunk_prep(
      q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...], docc_ref[...],
      docr_ref[...], sees_ref[...], last_ref[...], scale=cfg.scale, sub=cfg.sub,
      mm_dtype=cfg.mm, precision=cfg.prep_prec)
  for ref, x in ((w_ref, w), (u_ref, u), (a_ref, a), (qs_ref, qs), (ks_ref, ks),
                 (dec_ref, dec)):
    ref[...] = x.astype(ref.dtype)


def _prep_dtypes(cfg):
  """Storage dtypes of (w, u, A_qk, q_s, k_s, dec): matmul operands in the operand dtype,
  u and dec (added to / multiplying fp32 values) in fp32."""
  mm = cfg.mm
  return mm, F32, mm, mm, mm, F32


def heads_major(platform):
  """The kernels' layout of per-token arrays: [B, H, Tp, D] on TPU (Mosaic tiles the last two
  block dims, so a block must be a head's rows), else the callers' [B, Tp, H, D], which
  saves a transpose of every input and gradient (H200, (8, 4096, 16, 128): 0.47 of 1.81 ms
  forward, 0.97 of 8.69 forward + backward, results/kda.md, session 10)."""
  return platform == "tpu"


def _token_shape(cfg, B, H, Tp, d):
  return (B, H, Tp, d) if heads_major(cfg.platform) else (B, Tp, H, d)


def _dims(cfg, x):
  """(B, H, Tp, D) of a per-token array in the kernels' layout."""
  if heads_major(cfg.platform):
    return x.shape
  B, Tp, H, D = x.shape
  return B, H, Tp, D


def _tokens(cfg, rows, cols, index):
  """BlockSpec of `rows` tokens x `cols` columns of one (batch row, head) of a per-token
  array in the kernels' layout; index(*program ids) -> (b, h, row block, column block)."""
  if heads_major(cfg.platform):
    return pl.BlockSpec((None, None, rows, cols), index)

  def seq_major(*ids):
    b, h, t, c = index(*ids)
    return b, t, h, c
  return pl.BlockSpec((None, rows, None, cols), seq_major)


def _chunk_specs(cfg):
  """BlockSpecs of one chunk per program, grid (B, H, N): (per-token [.., C, d] of d
  columns, per-token column [B, Tp, 1], the chunk's document row [B, N, 1, C])."""
  C = cfg.chunk
  tok = lambda d: _tokens(cfg, C, d, lambda b, h, n: (b, h, n, 0))
  col = pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0))
  row = pl.BlockSpec((None, None, 1, C), lambda b, h, n: (b, n, 0, 0))
  return tok, col, row


def prep_pallas(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last):
  """Per-token arrays in the kernels' layout (`heads_major`; shapes below as [B, H, Tp, D]):
  q, k, g [B, H, Tp, K]; v [B, H, Tp, V]; beta [B, H, Tp, 1]. doc_c [B, Tp, 1] int32;
  doc_r [B, N, 1, C] int32; sees, last [B, Tp, 1]. Returns w, q_s, k_s [B, H, Tp, K],
  u [B, H, Tp, V], A_qk [B, H, Tp, C], dec [B, H, N, 1, K]."""
  B, H, Tp, K = _dims(cfg, q)
  V = v.shape[-1]
  C = cfg.chunk
  N = Tp // C
  tok, col, row = _chunk_specs(cfg)
  dtypes = _prep_dtypes(cfg)
  out_shape = [jax.ShapeDtypeStruct(_token_shape(cfg, B, H, Tp, d), dt)
               for d, dt in zip((K, V, C, K, K), dtypes)]
  out_shape.append(jax.ShapeDtypeStruct((B, H, N, 1, K), F32))
  return _call(
      cfg, functools.partial(_prep_kernel, cfg=cfg), grid=(B, H, N),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col],
      out_specs=[tok(K), tok(V), tok(C), tok(K), tok(K),
                 pl.BlockSpec((None, None, None, 1, K), lambda b, h, n: (b, h, n, 0, 0))],
      out_shape=out_shape, num_warps=cfg.prep_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last)


# -------------------------------------------------------------------------------- recurrence


def _fwd_step(cfg, w, u, a, qs, ks, dec, st):
  """One chunk: (o [C, BV], the next state) from the state st [BV, K] (transposed)."""
  mm, prec = cfg.mm, cfg.precision
  v_new = u.astype(F32) - tile.dot(w, st, "nt", prec, mm)  # [C, BV]
  o = tile.dot(qs, st, "nt", prec, mm) + tile.dot(a, v_new, "nn", prec, mm)
  return o, st * dec + tile.dot(v_new, ks, "tn", prec, mm)


def _rec_fwd_kernel(w_ref, u_ref, a_ref, qs_ref, ks_ref, dec_ref, st0_ref, o_ref, st_ref,
                    *states_ref, cfg, n_chunks):
  """GPU / interpret form: one program per (b, h, V block) loops over the chunks."""
  C = cfg.chunk

  def body(n, st):  # st: [BV, K] fp32, the state (transposed) entering chunk n
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
  """TPU form: the chunks are the last (sequential) grid axis; the state lives in VMEM."""
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


def _block_v(cfg, V):
  if cfg.platform == "tpu":  # lane-dense blocks: all of V, or 128 columns
    return V if V <= 128 else 128
  return min(cfg.block_v, V)


def _tpu_params():
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  return pltpu, pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def rec_fwd(cfg, w, u, a, qs, ks, dec, st0, out_dtype, save_states):
  """prep's outputs (w, u, A_qk, q_s, k_s, dec) and the initial state st0 [B, H, V, K]
  (transposed) fp32. Returns o [B, H, Tp, V] in out_dtype (the kernels' layout), the final
  state [B, H, V, K] fp32 and, if save_states, the state entering each chunk
  [B, H, N, V, K] in the operand dtype."""
  B, H, Tp, K = _dims(cfg, w)
  V = u.shape[-1]
  N = dec.shape[2]
  C = cfg.chunk
  BV = _block_v(cfg, V)
  out_shape = [jax.ShapeDtypeStruct(_token_shape(cfg, B, H, Tp, V), out_dtype),
               jax.ShapeDtypeStruct((B, H, V, K), F32)]
  if save_states:
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, V, K), cfg.mm))
  args = (w, u, a, qs, ks, dec, st0)
  if cfg.platform == "tpu":
    tok = lambda d: _tokens(cfg, C, d, lambda b, h, i, n: (b, h, n, 0))
    vblk = _tokens(cfg, C, BV, lambda b, h, i, n: (b, h, n, i))
    state = pl.BlockSpec((None, None, BV, K), lambda b, h, i, n: (b, h, i, 0))
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
  full = lambda d: _tokens(cfg, Tp, d, lambda b, h, i: (b, h, 0, 0))
  vblk = _tokens(cfg, Tp, BV, lambda b, h, i: (b, h, 0, i))
  state = pl.BlockSpec((None, None, BV, K), lambda b, h, i: (b, h, i, 0))
  out_specs = [vblk, state]
  if save_states:
    out_specs.append(pl.BlockSpec((None, None, N, BV, K), lambda b, h, i: (b, h, 0, i, 0)))
  return _call(
      cfg, functools.partial(_rec_fwd_kernel, cfg=cfg, n_chunks=N), grid=(B, H, V // BV),
      in_specs=[full(K), vblk, full(C), full(K), full(K),
                pl.BlockSpec((None, None, N, 1, K), lambda b, h, i: (b, h, 0, 0, 0)), state],
      out_specs=out_specs, out_shape=out_shape, num_warps=cfg.rec_warps, num_stages=cfg.rec_stages,
  )(*args)


def _rec_bwd_step(cfg, w, a, qs, ks, dec, do, dst):
  """One chunk backwards, the sequential part only: from the cotangent of the state leaving
  the chunk (dst [BV, K]) the cotangent of v_new [C, BV] and of the state entering it."""
  mm, prec = cfg.mm, cfg.precision
  dvn = tile.dot(a, do, "tn", prec, mm) + tile.dot(ks, dst, "nt", prec, mm)
  dst = dst * dec + tile.dot(do, qs, "tn", prec, mm) - tile.dot(dvn, w, "tn", prec, mm)
  return dvn, dst


def _rec_bwd_kernel(w_ref, a_ref, qs_ref, ks_ref, dec_ref, do_ref, dst_ref, dvn_ref, dsts_ref,
                    dst0_ref, *, cfg, n_chunks):
  """GPU / interpret form: one program per (b, h, V block), chunks in reverse."""
  C = cfg.chunk

  def body(i, dst):  # dst: [BV, K] fp32, cotangent of the state leaving chunk n
    n = n_chunks - 1 - i
    rows = pl.ds(pl.multiple_of(n * C, C), C)
    dsts_ref[n] = dst.astype(dsts_ref.dtype)
    dvn, dst = _rec_bwd_step(cfg, w_ref[rows, :], a_ref[rows, :], qs_ref[rows, :],
                             ks_ref[rows, :], dec_ref[n], do_ref[rows, :], dst)
    dvn_ref[rows, :] = dvn
    return dst

  dst0_ref[...] = lax.fori_loop(0, n_chunks, body, dst_ref[...].astype(F32))


def _rec_bwd_kernel_tpu(w_ref, a_ref, qs_ref, ks_ref, dec_ref, do_ref, dst_ref, dvn_ref,
                        dsts_ref, dst0_ref, scratch, *, cfg, n_chunks):
  """TPU form: grid step n handles chunk N - 1 - n; the state's cotangent lives in VMEM."""
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


def rec_bwd(cfg, w, a, qs, ks, dec, do, dst):
  """The recurrence backwards, sequential part: the cotangents of v_new [B, H, Tp, V] fp32
  (the kernels' layout), of the state leaving each chunk [B, H, N, V, K] (transposed, in the
  operand dtype) and of the initial state [B, H, V, K] fp32, from do [B, H, Tp, V] and the
  final state's dst."""
  B, H, Tp, K = _dims(cfg, w)
  V = do.shape[-1]
  N = dec.shape[2]
  C = cfg.chunk
  BV = _block_v(cfg, V)
  out_shape = [jax.ShapeDtypeStruct(_token_shape(cfg, B, H, Tp, V), F32),
               jax.ShapeDtypeStruct((B, H, N, V, K), cfg.mm),
               jax.ShapeDtypeStruct((B, H, V, K), F32)]
  args = (w, a, qs, ks, dec, do, dst)
  if cfg.platform == "tpu":
    r = lambda n: N - 1 - n  # chunks in reverse
    tok = lambda d: _tokens(cfg, C, d, lambda b, h, i, n: (b, h, r(n), 0))
    vblk = _tokens(cfg, C, BV, lambda b, h, i, n: (b, h, r(n), i))
    state = pl.BlockSpec((None, None, BV, K), lambda b, h, i, n: (b, h, i, 0))
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
  full = lambda d: _tokens(cfg, Tp, d, lambda b, h, i: (b, h, 0, 0))
  vblk = _tokens(cfg, Tp, BV, lambda b, h, i: (b, h, 0, i))
  state = pl.BlockSpec((None, None, BV, K), lambda b, h, i: (b, h, i, 0))
  return _call(
      cfg, functools.partial(_rec_bwd_kernel, cfg=cfg, n_chunks=N), grid=(B, H, V // BV),
      in_specs=[full(K), full(C), full(K), full(K),
                pl.BlockSpec((None, None, N, 1, K), lambda b, h, i: (b, h, 0, 0, 0)),
                vblk, state],
      out_specs=[vblk, pl.BlockSpec((None, None, N, BV, K), lambda b, h, i: (b, h, 0, i, 0)),
                 state],
      out_shape=out_shape, num_warps=cfg.rec_warps, num_stages=cfg.rec_stages,
  )(*args)


# ------------------------------------------------------------------------- chunk backward


def _chunk_cots_kernel(w_ref, u_ref, st_ref, dst_ref, do_ref, dvn_ref, dw_ref, da_ref,
                       dqs_ref, dks_ref, ddec_ref, *, cfg):
  mm, prec = cfg.mm, cfg.precision
  st, dst = st_ref[...], dst_ref[...]  # [V, K]: entering / (cotangent) leaving the chunk
  do, dvn = do_ref[...], dvn_ref[...]
  v_new = u_ref[...] - tile.dot(w_ref[...], st, "nt", prec, mm)  # [C, V]
  dw_ref[...] = -tile.dot(dvn, st, "nn", prec, mm)
  da_ref[...] = tile.dot(do, v_new, "nt", prec, mm)
  dqs_ref[...] = tile.dot(do, st, "nn", prec, mm)
  dks_ref[...] = tile.dot(v_new, dst, "nn", prec, mm)
  ddec_ref[...] = jnp.sum(st.astype(F32) * dst.astype(F32), axis=0, keepdims=True)


def chunk_cots(cfg, w, u, states, dstates, do, dvn):
  """The cotangents of prep's outputs w, A_qk, q_s, k_s and dec (that of u is dvn), one
  program per chunk: from those of o (do [B, H, Tp, V]), of v_new (dvn) and of the state
  leaving each chunk (dstates [B, H, N, V, K]), with the state entering it (states) and
  v_new = u - w S recomputed. Returns dw, dq_s, dk_s [B, H, Tp, K], dA_qk [B, H, Tp, C] and
  ddec [B, H, N, 1, K], fp32. The products with the [V, K] states, apart from `chunk_bwd`:
  one kernel holding both ran out of registers (H200: 255 per thread, spilling)."""
  B, H, Tp, K = _dims(cfg, w)
  C, N, V = cfg.chunk, states.shape[2], u.shape[-1]
  tok, _, _ = _chunk_specs(cfg)
  state = pl.BlockSpec((None, None, None, V, K), lambda b, h, n: (b, h, n, 0, 0))
  per_chunk = pl.BlockSpec((None, None, None, 1, K), lambda b, h, n: (b, h, n, 0, 0))
  out_shape = [jax.ShapeDtypeStruct(_token_shape(cfg, B, H, Tp, d), F32) for d in (K, C, K, K)]
  out_shape.append(jax.ShapeDtypeStruct((B, H, N, 1, K), F32))
  return _call(
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
      mm_dtype=cfg.mm, precision=cfg.bwd_prec)
  grads = vjp(dw_ref[...], du_ref[...], da_ref[...], dqs_ref[...], dks_ref[...],
              ddec_ref[...])
  for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref), grads):
    ref[...] = x.astype(ref.dtype)


def chunk_bwd(cfg, q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec):
  """The cotangents of q, k, v, g, beta (their shapes and dtypes; fp32 inside) from those of
  prep's outputs (`chunk_cots`; du = the cotangent of v_new), one program per chunk: the
  chunk's prep recomputed in registers and its vjp derived by hand
  (`tile.chunk_prep_vjp`)."""
  C, K, V = cfg.chunk, q.shape[-1], v.shape[-1]
  tok, col, row = _chunk_specs(cfg)
  per_chunk = pl.BlockSpec((None, None, None, 1, K), lambda b, h, n: (b, h, n, 0, 0))
  B, H, Tp, _ = _dims(cfg, q)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta)]
  return _call(
      cfg, functools.partial(_chunk_bwd_kernel, cfg=cfg), grid=(B, H, Tp // C),
      in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), col, row, col, col,
                tok(K), tok(V), tok(C), tok(K), tok(K), per_chunk],
      out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1)],
      out_shape=out_shape, num_warps=cfg.bwd_warps,
  )(q, k, v, g, beta, doc_c, doc_r, sees, last, dw, du, da, dqs, dks, ddec)


# ------------------------------------------------------------------------------ custom_vjp


def _forward(cfg, q, k, v, g, beta, st0, masks, save_states):
  """prep and the recurrence: o, the final state, prep's outputs and the chunk states (None
  unless saved)."""
  prep = prep_pallas(cfg, q, k, v, g, beta, *masks)
  o, st, *states = rec_fwd(cfg, *prep, st0, q.dtype, save_states)
  return o, st, prep, (states[0] if save_states else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  o, st, _, _ = _forward(cfg, q, k, v, g, beta, st0, (doc_c, doc_r, sees, last), False)
  return o, st


def _core_fwd(cfg, q, k, v, g, beta, st0, doc_c, doc_r, sees, last):
  o, st, prep, states = _forward(cfg, q, k, v, g, beta, st0, (doc_c, doc_r, sees, last),
                                 cfg.save_states)
  saved = (*prep, states) if cfg.save_states else None
  return (o, st), (q, k, v, g, beta, st0, doc_c, doc_r, sees, last, saved)


def _core_bwd(cfg, res, cots):
  q, k, v, g, beta, st0, doc_c, doc_r, sees, last, saved = res
  do, dst = cots
  masks = (doc_c, doc_r, sees, last)
  if saved is None:  # recompute prep's outputs and the chunk states
    prep = prep_pallas(cfg, q, k, v, g, beta, *masks)
    saved = (*prep, rec_fwd(cfg, *prep, st0, q.dtype, True)[2])
  w, u, a, qs, ks, dec, states = saved
  dvn, dstates, dst0 = rec_bwd(cfg, w, a, qs, ks, dec, do, dst)
  dw, da, dqs, dks, ddec = chunk_cots(cfg, w, u, states, dstates, do, dvn)
  dq, dk, dv, dg, dbeta = chunk_bwd(cfg, q, k, v, g, beta, *masks, dw, dvn, da, dqs, dks,
                                    ddec)
  zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dq, dk, dv, dg, dbeta, dst0,
          zero_int(doc_c), zero_int(doc_r), jnp.zeros_like(sees), jnp.zeros_like(last))


_kda_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------- wrapper


def _pow2(n, lo=16):
  return max(lo, 1 << (n - 1).bit_length())


def kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
               output_final_state=False, chunk_size=None, sub_chunk_size=16, interpret=False,
               platform=None, block_v=None, save_states=True, **tuning):
  """Chunked KDA through the Pallas kernels; same contract as `kda_naive`, for any T.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] with LOWER_BOUND <= g <= 0;
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
      BLOCKS_V with B * H * V / block_v >= MIN_PROGRAMS, else the narrowest (long sequences
      of few rows and heads).
    save_states: keep prep's outputs and the state entering each chunk for the backward
      (else recompute them there).
    tuning: further `Config` fields (prep_warps, prep_precision, rec_stages, rec_warps,
      cots_warps, bwd_warps, bwd_precision).

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
  if heads_major(cfg.platform):
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
  platform = platform or ("cpu" if interpret else jax.default_backend())
  if platform == "cuda":
    platform = "gpu"
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
  if -LOWER_BOUND * (L - 1) > _MAX_EXPONENT:
    raise ValueError(f"sub_chunk_size={L} is too long for the gate bound {LOWER_BOUND}")
  Kp, Vp = _pow2(K), _pow2(V)
  if block_v is None:
    block_v = next((bv for bv in BLOCKS_V if B * H * max(1, Vp // bv) >= MIN_PROGRAMS),
                   BLOCKS_V[-1])
  cfg = Config(scale=float(K ** -0.5 if scale is None else scale), chunk=C, sub=L,
               block_v=block_v, mm_dtype=jnp.dtype(q.dtype).name if q.dtype == jnp.bfloat16
               else "float32", interpret=interpret, platform=platform,
               save_states=save_states, **tuning)
  pad_t = -T % C
  Tp, N = T + pad_t, (T + pad_t) // C
  bv = min(block_v, Vp)
  if Vp % bv:
    raise ValueError(f"block_v={block_v} does not divide the padded V={Vp}")

  def layout(x, d_pad):  # [B, T, H, D] -> [B, Tp, H, D + d_pad]; zeros change nothing
    x = jnp.pad(x, [(0, 0), (0, pad_t), (0, 0), (0, d_pad)])
    return jnp.swapaxes(x, 1, 2) if heads_major(platform) else x

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

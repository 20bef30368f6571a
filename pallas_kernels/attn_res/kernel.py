"""The Block AttnRes read as Pallas Triton kernels, fp32 inside. A program takes a block of
tokens and all S sources: a first pass over d-tiles sums each source's squares and its dot
with w g (and, backward, with dh), then the softmax over sources, then a second pass mixes
the sources (forward) or writes their cotangents (backward): the [S, B, T, d] buffer is
read twice a call and nothing of its size is written but the cotangent. The sources are one
[S, N, d] buffer or S separate [N, d] arrays (each read, and its cotangent written, in place).

With r_s = rsqrt(mean(v_s^2) + eps), dot_s = v_s . wg, logit_s = r_s dot_s:
  dv_s = alpha_s dh + dlogit_s (r_s wg - r_s^3 dot_s v_s / d),
  dlogit_s = alpha_s (dh . v_s - dh . h),   dwg = sum_tokens,s dlogit_s r_s v_s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attn_res.reference import (F32, Sources, check_shapes, is_buffer,
                                               sources_shape)
from pallas_kernels.platform import lowered_once, triton_call

BLOCK_N = 16    # tokens a program
BLOCK_D = 256   # widest d-tile
NUM_WARPS = 4


class _Blocks:
  """A program's block of the S sources (or of their cotangents), [BN, d] each: `refs` is
  one [S, BN, d] ref (a buffer) or S [BN, d] refs; `self[s, cols]` reads, `=` writes."""

  def __init__(self, refs, buffer: bool):
    self.refs, self.buffer = refs, buffer
    self.count = refs[0].shape[0] if buffer else len(refs)
    self.rows, self.width = refs[0].shape[-2], refs[0].shape[-1]

  def __getitem__(self, index):
    s, cols = index
    return self.refs[0][s, :, cols] if self.buffer else self.refs[s][:, cols]

  def __setitem__(self, index, value):
    s, cols = index
    if self.buffer:
      self.refs[0][s, :, cols] = value
    else:
      self.refs[s][:, cols] = value


def _split(refs, num, buffer):
  """(the sources' `_Blocks`, the refs after them): num is S, or 1 for a buffer."""
  return _Blocks(refs[:num], buffer), refs[num:]


def _tiles(d, block_d):
  n = d // block_d
  return n, lambda j: pl.ds(pl.multiple_of(j * block_d, block_d), block_d)


def _stats(src, wg_ref, dh_ref, block_d):
  """Per source s: (sum v_s^2, v_s . wg, v_s . dh or None), each [BN] fp32."""
  S, BN = src.count, src.rows
  n, tile = _tiles(src.width, block_d)
  zero = jnp.zeros((BN,), F32)
  width = 3 if dh_ref is not None else 2

  def body(j, acc):
    cols = tile(j)
    wg = wg_ref[cols][None, :]
    dh = dh_ref[:, cols].astype(F32) if dh_ref is not None else None
    acc = list(acc)
    for s in range(S):
      v = src[s, cols].astype(F32)
      acc[width * s] += jnp.sum(v * v, axis=1)
      acc[width * s + 1] += jnp.sum(v * wg, axis=1)
      if dh is not None:
        acc[width * s + 2] += jnp.sum(v * dh, axis=1)
    return tuple(acc)

  acc = jax.lax.fori_loop(0, n, body, (zero,) * (width * S))
  return [(acc[width * s], acc[width * s + 1], acc[width * s + 2] if width == 3 else None)
          for s in range(S)]


def _softmax(valid_ref, stats, d, eps):
  """(alpha_s, r_s) per source, [BN] each; invalid sources weigh exactly 0."""
  rs = [jax.lax.rsqrt(sq / d + eps) for sq, _, _ in stats]
  ok = [valid_ref[s] != 0 for s in range(len(stats))]
  logits = [jnp.where(ok[s], rs[s] * stats[s][1], -jnp.inf) for s in range(len(stats))]
  top = logits[0]
  for lg in logits[1:]:
    top = jnp.maximum(top, lg)
  ex = [jnp.where(ok[s], jnp.exp(logits[s] - top), 0.0) for s in range(len(stats))]
  total = ex[0]
  for e in ex[1:]:
    total += e
  return [e / total for e in ex], rs


def _fwd_kernel(*refs, num, buffer, eps, block_d):
  src, (valid_ref, wg_ref, h_ref) = _split(refs, num, buffer)
  d = src.width
  alpha, _ = _softmax(valid_ref, _stats(src, wg_ref, None, block_d), d, eps)
  n, tile = _tiles(d, block_d)

  def body(j, carry):
    cols = tile(j)
    h = alpha[0][:, None] * src[0, cols].astype(F32)
    for s in range(1, src.count):
      h += alpha[s][:, None] * src[s, cols].astype(F32)
    h_ref[:, cols] = h.astype(h_ref.dtype)
    return carry

  jax.lax.fori_loop(0, n, body, 0)


def _bwd_kernel(*refs, num, buffer, eps, block_d):
  src, rest = _split(refs, num, buffer)
  valid_ref, wg_ref, dh_ref = rest[:3]
  dsrc, (dwg_ref,) = _split(rest[3:], num, buffer)
  S, d = src.count, src.width
  stats = _stats(src, wg_ref, dh_ref, block_d)
  alpha, rs = _softmax(valid_ref, stats, d, eps)
  dh_h = alpha[0] * stats[0][2]                 # dh . h = sum_s alpha_s (dh . v_s)
  for s in range(1, S):
    dh_h += alpha[s] * stats[s][2]
  dlogit = [alpha[s] * (stats[s][2] - dh_h) for s in range(S)]
  c_wg = [dlogit[s] * rs[s] for s in range(S)]                   # of wg in dv_s
  c_v = [c_wg[s] * rs[s] * rs[s] * stats[s][1] / d for s in range(S)]  # of v_s in dv_s
  n, tile = _tiles(d, block_d)

  def body(j, carry):
    cols = tile(j)
    wg = wg_ref[cols][None, :]
    dh = dh_ref[:, cols].astype(F32)
    dwg = jnp.zeros((cols.size,), F32)
    for s in range(S):
      v = src[s, cols].astype(F32)
      dv = alpha[s][:, None] * dh + c_wg[s][:, None] * wg - c_v[s][:, None] * v
      dsrc[s, cols] = dv.astype(dsrc.refs[0].dtype)
      dwg += jnp.sum(c_wg[s][:, None] * v, axis=0)
    dwg_ref[cols] = dwg
    return carry

  jax.lax.fori_loop(0, n, body, 0)


def _specs(src, block_n):
  """Grid (N / BN,): ([the sources' blocks], valid, wg, a [BN, d] block, a [d] row)."""
  S, N, d = sources_shape(src)
  block = pl.BlockSpec((block_n, d), lambda i: (i, 0))
  sources = ([pl.BlockSpec((S, block_n, d), lambda i: (0, i, 0))] if is_buffer(src)
             else [block] * S)
  valid = pl.BlockSpec((S,), lambda i: (0,))
  row = pl.BlockSpec((d,), lambda i: (0,))
  per_block = pl.BlockSpec((None, d), lambda i: (i, 0))
  return sources, valid, row, block, per_block


def _flat(src):
  """The kernel's source operands: [the buffer] or the S arrays."""
  return [src] if is_buffer(src) else list(src)


def _kernel(fn, src, eps, block_d):
  return functools.partial(fn, num=len(_flat(src)), buffer=is_buffer(src), eps=eps,
                           block_d=block_d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(eps, blocks, interpret, src, valid, wg):
  """src: [S, N, d] or a tuple of S [N, d]; blocks: (tokens a program, d-tile, warps)."""
  return _forward(eps, blocks, interpret, src, valid, wg)


@lowered_once(0, 1, 2)
def _forward(eps, blocks, interpret, src, valid, wg):
  block_n, block_d, num_warps = blocks
  _, N, d = sources_shape(src)
  sources, valid_spec, row, block, _ = _specs(src, block_n)
  return triton_call(_kernel(_fwd_kernel, src, eps, block_d), *_flat(src), valid, wg,
                     grid=(N // block_n,), in_specs=[*sources, valid_spec, row],
                     out_specs=block, out_shape=jax.ShapeDtypeStruct((N, d), _flat(src)[0].dtype),
                     interpret=interpret, num_warps=num_warps, num_stages=2)


def _attend_fwd(eps, blocks, interpret, src, valid, wg):
  return _forward(eps, blocks, interpret, src, valid, wg), (src, valid, wg)


def _attend_bwd(eps, blocks, interpret, res, dh):
  return _backward(eps, blocks, interpret, *res, dh)


@lowered_once(0, 1, 2)
def _backward(eps, blocks, interpret, src, valid, wg, dh):
  """(d_sources like src, None for valid, d_wg)."""
  block_n, block_d, num_warps = blocks
  _, N, d = sources_shape(src)
  sources, valid_spec, row, block, per_block = _specs(src, block_n)
  flat = _flat(src)
  *dsrc, dwg = triton_call(
      _kernel(_bwd_kernel, src, eps, block_d), *flat, valid, wg, dh, grid=(N // block_n,),
      in_specs=[*sources, valid_spec, row, block], out_specs=[*sources, per_block],
      out_shape=[*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat),
                 jax.ShapeDtypeStruct((N // block_n, d), F32)], interpret=interpret,
      num_warps=num_warps, num_stages=2)
  return (dsrc[0] if is_buffer(src) else tuple(dsrc)), None, jnp.sum(dwg, axis=0)


_attend.defvjp(_attend_fwd, _attend_bwd)


def supports(shape, block_n: int = BLOCK_N) -> bool:
  """Whether the kernels take sources of shape (S, B, T, d): d a multiple of 16, B T of
  block_n."""
  _, B, T, d = shape
  return d % 16 == 0 and (B * T) % block_n == 0


def attend_pallas(sources: Sources, valid: jax.Array | None, query: jax.Array,
                  key_gain: jax.Array, eps: float, *, interpret: bool = False,
                  block_n: int = BLOCK_N, block_d: int = BLOCK_D,
                  num_warps: int = NUM_WARPS) -> jax.Array:
  """`attend_reference` through the kernels: sources [S, B, T, d] (or S arrays [B, T, d],
  read where they lie) -> h [B, T, d]; a program takes block_n tokens, d in tiles of up to
  block_d."""
  check_shapes(sources, valid, query, key_gain)
  S, B, T, d = sources_shape(sources)
  if not supports((S, B, T, d), block_n):
    raise ValueError(f"attn_res kernels: need d % 16 == 0 and B * T % {block_n} == 0, "
                     f"got sources of shape {(S, B, T, d)}")
  block_d = next(b for b in (block_d, 128, 64, 32, 16) if d % b == 0 and b <= block_d)
  valid = (jnp.ones((S,), jnp.int32) if valid is None else valid.astype(jnp.int32))
  wg = query.astype(F32) * key_gain.astype(F32)
  src = (sources.reshape(S, B * T, d) if is_buffer(sources)
         else tuple(x.reshape(B * T, d) for x in sources))
  h = _attend(float(eps), (block_n, block_d, num_warps), interpret, src, valid, wg)
  return h.reshape(B, T, d)

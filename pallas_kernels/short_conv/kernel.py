"""KDA's short convolution as Pallas Triton kernels, fp32 inside: y = silu(p) (L2-normalized
if asked), p = sum_j w[j] x[t - j]. A program per (row, block of T, head) gathers its rows
and the W - 1 before them by index, masked at the start and at document boundaries. Backward
(only x saved): `_grad_p_kernel` (dp, per-block tap sums from dp in fp32), `_grad_x_kernel`
(dx = w * dp). Storing dp beats recomputing it at the W rows each dx row reads; stored in x's
dtype (bf16 in the model), dx takes one more rounding for less traffic:
benchmarks/results/short_conv.md."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.platform import lowered_once, triton_call
from pallas_kernels.short_conv.reference import EPS, F32, check_shapes

BLOCK_T = 16


def _rows(block_t):
  return pl.program_id(1) * block_t + jnp.arange(block_t)


def _tap(ref, seg_ref, t, seg_t, j, limit):
  """ref's rows t + j (fp32), zero outside [0, limit) or in another document than t."""
  r = t + j
  ok = (r >= 0) & (r < limit)
  r = jnp.clip(r, 0, limit - 1)
  ok = ok & (seg_ref[r] == seg_t)
  return jnp.where(ok[:, None], ref[r, :].astype(F32), 0.0)


def _window(x_ref, seg_ref, t, seg_t, taps, limit):
  """x_t, x_{t-1}, ..., x_{t-W+1} (fp32 [BT, D] each, masked as `_tap`), one at a time."""
  yield x_ref[t, :].astype(F32)
  for j in range(1, taps):
    yield _tap(x_ref, seg_ref, t, seg_t, -j, limit)


def _preact(window, w_ref):
  """sum_j w[j] window[j]; a generator's rows are read as they are summed."""
  return functools.reduce(operator.add, (x * w_ref[j, :].astype(F32)[None]
                                         for j, x in enumerate(window)))


def _act(p, normalize):
  """(y, sigmoid(p), 1 / |silu(p)| or None)."""
  sg = jax.nn.sigmoid(p)
  s = p * sg
  if not normalize:
    return s, sg, None
  r = jax.lax.rsqrt(jnp.sum(s * s, axis=1, keepdims=True) + EPS)
  return s * r, sg, r


def _fwd_kernel(x_ref, w_ref, seg_ref, y_ref, *, taps, normalize, block_t):
  t = _rows(block_t)
  limit = x_ref.shape[0]
  p = _preact(_window(x_ref, seg_ref, t, seg_ref[t], taps, limit), w_ref)
  y_ref[...] = _act(p, normalize)[0].astype(y_ref.dtype)


def _grad_p_kernel(x_ref, w_ref, seg_ref, dy_ref, dp_ref, dw_ref, *, taps, normalize,
                   block_t):
  t = _rows(block_t)
  limit, seg_t = x_ref.shape[0], seg_ref[t]
  window = list(_window(x_ref, seg_ref, t, seg_t, taps, limit))  # for p and the taps' sums
  p = _preact(window, w_ref)
  y, sg, r = _act(p, normalize)
  dy = dy_ref[...].astype(F32)
  ds = r * (dy - y * jnp.sum(dy * y, axis=1, keepdims=True)) if normalize else dy
  dp = ds * sg * (1.0 + p * (1.0 - sg))
  dp_ref[...] = dp.astype(dp_ref.dtype)
  for j in range(taps):
    dw_ref[j, :] = jnp.sum(window[j] * dp, axis=0)


def _grad_x_kernel(dp_ref, w_ref, seg_ref, dx_ref, *, taps, block_t):
  t = _rows(block_t)
  limit, seg_t = dp_ref.shape[0], seg_ref[t]
  dx = dp_ref[t, :].astype(F32) * w_ref[0, :].astype(F32)[None]
  for j in range(1, taps):
    dx += _tap(dp_ref, seg_ref, t, seg_t, j, limit) * w_ref[j, :].astype(F32)[None]
  dx_ref[...] = dx.astype(dx_ref.dtype)


def _specs(Tp, D, Wp, block_t):
  """Grid (B, Tp / BT, H): (a head's rows, its row block, its taps, the row's ids)."""
  whole = pl.BlockSpec((None, Tp, None, D), lambda b, i, h: (b, 0, h, 0))
  block = pl.BlockSpec((None, block_t, None, D), lambda b, i, h: (b, i, h, 0))
  taps = pl.BlockSpec((Wp, None, D), lambda b, i, h: (0, h, 0))
  seg = pl.BlockSpec((None, Tp), lambda b, i, h: (b, 0))
  return whole, block, taps, seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _conv(taps, normalize, block_t, interpret, dp_dtype, x, w, seg):
  return _conv_forward(taps, normalize, block_t, interpret, x, w, seg)


@lowered_once(0, 1, 2, 3)
def _conv_forward(taps, normalize, block_t, interpret, x, w, seg):
  B, Tp, H, D = x.shape
  whole, block, taps_spec, seg_spec = _specs(Tp, D, w.shape[0], block_t)
  kernel = functools.partial(_fwd_kernel, taps=taps, normalize=normalize, block_t=block_t)
  return triton_call(kernel, x, w, seg, grid=(B, Tp // block_t, H),
                     in_specs=[whole, taps_spec, seg_spec], out_specs=block,
                     out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)


def _conv_fwd(taps, normalize, block_t, interpret, dp_dtype, x, w, seg):
  return _conv_forward(taps, normalize, block_t, interpret, x, w, seg), (x, w, seg)


def _conv_bwd(taps, normalize, block_t, interpret, dp_dtype, res, dy):
  return _conv_backward(taps, normalize, block_t, interpret, dp_dtype, *res, dy) + (None,)


@lowered_once(0, 1, 2, 3, 4)
def _conv_backward(taps, normalize, block_t, interpret, dp_dtype, x, w, seg, dy):
  """(dx, dw)."""
  B, Tp, H, D = x.shape
  Wp, n = w.shape[0], Tp // block_t
  whole, block, taps_spec, seg_spec = _specs(Tp, D, Wp, block_t)
  grid = (B, n, H)
  dw_spec = pl.BlockSpec((None, None, Wp, None, D), lambda b, i, h: (b, i, 0, h, 0))
  kernel = functools.partial(_grad_p_kernel, taps=taps, normalize=normalize, block_t=block_t)
  dp, dw_blocks = triton_call(
      kernel, x, w, seg, dy, grid=grid, in_specs=[whole, taps_spec, seg_spec, block],
      out_specs=[block, dw_spec],
      out_shape=[jax.ShapeDtypeStruct(x.shape, dp_dtype),
                 jax.ShapeDtypeStruct((B, n, Wp, H, D), F32)], interpret=interpret)
  kernel = functools.partial(_grad_x_kernel, taps=taps, block_t=block_t)
  dx = triton_call(kernel, dp, w, seg, grid=grid, in_specs=[whole, taps_spec, seg_spec],
                   out_specs=block, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                   interpret=interpret)
  dw = jnp.sum(dw_blocks, axis=(0, 1)).astype(w.dtype)
  return dx, dw


_conv.defvjp(_conv_fwd, _conv_bwd)


def short_conv_pallas(x: jax.Array, weight: jax.Array, segment_ids: jax.Array, *,
                      normalize: bool = False, block_t: int = BLOCK_T,
                      dp_dtype: str | None = None, interpret: bool = False) -> jax.Array:
  """`short_conv_reference` through the kernels (T, D and W padded to Triton's blocks);
  dp_dtype: the backward's stored pre-activation gradient, None: x's (the taps' sums take it
  in fp32 either way)."""
  check_shapes(x, weight, segment_ids)
  B, T, H, D = x.shape
  W = weight.shape[0]
  pow2 = pl.next_power_of_2
  block_t = min(block_t, max(16, pow2(T)))
  Tp, Dp, Wp = -(-T // block_t) * block_t, max(16, pow2(D)), pow2(W)
  if (Tp, Dp) != (T, D):
    x = jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D)))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, Tp - T)), constant_values=-1)
  if (Wp, Dp) != (W, D):
    weight = jnp.pad(weight, ((0, Wp - W), (0, 0), (0, Dp - D)))
  y = _conv(W, normalize, block_t, interpret, jnp.dtype(dp_dtype or x.dtype).name, x, weight,
            segment_ids.astype(jnp.int32))
  return y[:, :T, :, :D]

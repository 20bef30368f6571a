"""Pallas kernels for Newton-Schulz's Gram form (`gram.py`): X X^T, the polynomial q, q @ X in
one program per block ("whole": Mosaic on TPU, Triton on GPU), or on GPU in Gram, iteration
and apply kernels that fill the SMs when blocks are few. bf16: q as bf16 hi + lo."""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.newton_schulz.gram import dot_f32, gram_matrix_polynomial, split_bf16
from pallas_kernels.newton_schulz.reference import COEFFS, EPS, STEPS, short_wide

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32
GPU_MAX_ROWS = 128  # the GPU Gram kernel keeps an [m, m] float32 accumulator in registers
TPU_MAX_BLOCK_BYTES = 10 * 2**20  # VMEM holds 2 input and 2 output blocks
GPU_TARGET_PROGRAMS = 264  # 2 programs per SM of an H100/H200
WHOLE_MIN_BLOCKS = 64
# bf16 inputs' GPU iteration operands: fp16 has tf32's mantissa at twice its rate, and the
# normalized Gram matrix keeps q within its range; bf16x3 is closer on ill-conditioned blocks
GPU_ITERATE = {"fp16": jnp.float16,
               "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3}


def _out_struct(shape, dtype, like):
  """A ShapeDtypeStruct varying over `like`'s shard_map axes, as Pallas needs there."""
  aval = jax.typeof(like)
  params = inspect.signature(jax.ShapeDtypeStruct).parameters
  for name in ("manual_axis_type", "vma"):
    if name in params and hasattr(aval, name):
      return jax.ShapeDtypeStruct(shape, dtype, **{name: getattr(aval, name)})
  return jax.ShapeDtypeStruct(shape, dtype)


def _round_up(v, k):
  return -(-v // k) * k


def _dot(u, v, contract_rhs, exact):
  """[p, k] x [q, k] (contract_rhs=1) or [k, q] (contract_rhs=0) -> [p, q] float32."""
  dims = (((1,), (contract_rhs,)), ((), ()))
  return jax.lax.dot_general(u, v, dims, precision=_HI if exact else None,
                             preferred_element_type=_F32)


def _apply_operands(q, exact):
  """q [m, m] float32 -> the operands of q @ X: (q,) for float32, (lo, hi) bf16 parts."""
  return (q,) if exact else split_bf16(q)[::-1]


def _apply_tiles(q_parts, x_ref, o_ref, tn, exact):
  """o_ref[:, tile] = q @ x_ref[:, tile] for every column tile of x_ref [m, k * tn]."""

  def body(j, carry):
    cols = pl.ds(pl.multiple_of(j * tn, tn), tn)
    xt = x_ref[:, cols]
    acc = _dot(q_parts[0], xt, 0, exact)
    for part in q_parts[1:]:
      acc += _dot(part, xt, 0, exact)
    o_ref[:, cols] = acc.astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, x_ref.shape[1] // tn, body, 0)


def _gram_tiles(x_ref, first, count, tn, exact):
  """sum over column tiles first..first+count-1 of X_t X_t^T: [m, m] float32."""
  m = x_ref.shape[0]

  def body(j, acc):
    xt = x_ref[:, pl.ds(pl.multiple_of((first + j) * tn, tn), tn)]
    return acc + _dot(xt, xt, 1, exact)

  return jax.lax.fori_loop(0, count, body, jnp.zeros((m, m), _F32))


def _whole_kernel(x_ref, o_ref, *, tn, exact, poly):
  nt = x_ref.shape[1] // tn
  q = poly(_gram_tiles(x_ref, 0, nt, tn, exact))
  _apply_tiles(_apply_operands(q, exact), x_ref, o_ref, tn, exact)


def _gram_kernel(x_ref, g_ref, *, tn, exact):
  """g_ref [m, m]: the split's partial Gram matrix."""
  g_ref[...] = _gram_tiles(x_ref, 0, x_ref.shape[1] // tn, tn, exact)


def _poly_kernel(g_ref, q_ref, *, poly):
  gram = g_ref[0]
  for s in range(1, g_ref.shape[0]):
    gram += g_ref[s]
  q_ref[...] = poly(gram)


def _apply_kernel(q_ref, x_ref, o_ref, *, tn, exact):
  _apply_tiles(_apply_operands(q_ref[...], exact), x_ref, o_ref, tn, exact)


def _as_blocks(x, row_multiple, col_multiple):
  """[..., m, n] -> (blocks [B, m_pad, n_pad] short-wide, undo)."""
  xs, transposed = short_wide(x)
  lead, (m, n) = xs.shape[:-2], xs.shape[-2:]
  xs = xs.reshape((-1, m, n))
  m_pad, n_pad = _round_up(m, row_multiple), _round_up(n, col_multiple)
  if (m_pad, n_pad) != (m, n):
    xs = jnp.pad(xs, ((0, 0), (0, m_pad - m), (0, n_pad - n)))

  def undo(out):
    out = out[:, :m, :n].reshape(lead + (m, n))
    return jnp.swapaxes(out, -1, -2) if transposed else out

  return xs, undo


def _compute_dtype(x):
  return x.dtype if x.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32


def _tpu_layout(shape, dtype, tile_n=512):
  """(rows, column tile, columns) of a padded TPU block: rows in whole sublane tiles."""
  m, n = sorted(shape[-2:])
  tn = min(tile_n, _round_up(n, 128))
  return _round_up(m, 16 if dtype == jnp.bfloat16 else 8), tn, _round_up(n, tn)


def tpu_block_bytes(shape, dtype, tile_n=512):
  """Bytes of one padded block of the fused TPU kernel (dtypes other than bf16 as float32)."""
  dtype = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
  m_pad, _, n_pad = _tpu_layout(shape, dtype, tile_n)
  return m_pad * n_pad * jnp.dtype(dtype).itemsize


def newton_schulz_tpu(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, interpret=False, tile_n=512):
  """The fused Mosaic kernel: x [..., m, n] -> x's dtype; tile_n a multiple of 128."""
  out_dtype, dtype = x.dtype, _compute_dtype(x)
  exact = dtype == _F32
  rows, tn, _ = _tpu_layout(x.shape, dtype, tile_n)
  xb, undo = _as_blocks(x.astype(dtype), rows, tn)
  B, m_pad, n_pad = xb.shape
  block_bytes = tpu_block_bytes(x.shape, dtype, tile_n)
  if block_bytes > TPU_MAX_BLOCK_BYTES:
    raise ValueError(f"block [{m_pad}, {n_pad}] ({block_bytes} bytes) does not fit the fused "
                     f"TPU kernel's VMEM budget ({TPU_MAX_BLOCK_BYTES} bytes per block)")
  poly = functools.partial(gram_matrix_polynomial, steps=steps, coeffs=coeffs, eps=eps,
                           dot=dot_f32)
  kernel = functools.partial(_whole_kernel, tn=tn, exact=exact, poly=poly)
  spec = pl.BlockSpec((None, m_pad, n_pad), lambda b: (b, 0, 0))
  # 4 blocks double-buffered, plus [m, m] float32 temporaries and one tile's products.
  vmem = 4 * block_bytes + 16 * m_pad * m_pad * 4 + 8 * m_pad * tn * 4 + (4 << 20)
  out = pl.pallas_call(
      kernel,
      grid=(B,),
      in_specs=[spec],
      out_specs=spec,
      out_shape=_out_struct(xb.shape, dtype, xb),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=int(vmem)),
      interpret=interpret,
  )(xb)
  return undo(out).astype(out_dtype)


def _gpu_splits(num_blocks, num_tiles):
  """The smallest divisor of num_tiles giving GPU_TARGET_PROGRAMS programs, else num_tiles."""
  want = max(1, math.ceil(GPU_TARGET_PROGRAMS / num_blocks))
  return next((d for d in range(1, num_tiles + 1) if num_tiles % d == 0 and d >= want),
              num_tiles)


def _gpu_apply_tiles(num_blocks, num_tiles, most=4):
  """The largest divisor <= most of num_tiles leaving GPU_TARGET_PROGRAMS programs, else 1."""
  fits = [d for d in range(1, most + 1)
          if num_tiles % d == 0 and num_blocks * num_tiles // d >= GPU_TARGET_PROGRAMS]
  return max(fits, default=1)


def _iterate_dot(iterate_precision, exact: bool):
  """The Gram iteration's matmul: operands cast to a dtype, or at a lax precision."""
  if iterate_precision is None or iterate_precision in GPU_ITERATE:
    iterate_precision = _HI if exact else GPU_ITERATE[iterate_precision or "fp16"]
  if isinstance(iterate_precision, type):
    operand = iterate_precision
    return lambda u, v: jnp.matmul(u.astype(operand), v.astype(operand),
                                   preferred_element_type=_F32)
  return lambda u, v: jnp.matmul(u, v, precision=iterate_precision, preferred_element_type=_F32)


def _whole_call(xb, poly, tn, exact, params, interpret):
  """One program a block [m_pad, n_pad] of xb [B, m_pad, n_pad]: Gram, iteration, apply."""
  spec = pl.BlockSpec((None, *xb.shape[1:]), lambda b: (b, 0, 0))
  return pl.pallas_call(
      functools.partial(_whole_kernel, tn=tn, exact=exact, poly=poly),
      grid=(xb.shape[0],),
      in_specs=[spec],
      out_specs=spec,
      out_shape=_out_struct(xb.shape, xb.dtype, xb),
      compiler_params=params,
      interpret=interpret,
  )(xb)


def newton_schulz_gpu(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, interpret=False, tile_n=None,
                      splits=None, apply_tiles=None, iterate=None, iterate_precision=None,
                      num_warps=4, num_stages=3, iterate_warps=8):
  """The Triton kernels, min(m, n) <= GPU_MAX_ROWS. iterate: "whole", "kernel" or "xla"
  (fp32's default: Triton's fp32 dots unroll into FMA code too long to compile)."""
  out_dtype, dtype = x.dtype, _compute_dtype(x)
  exact = dtype == _F32
  m, n = sorted(x.shape[-2:])
  if m > GPU_MAX_ROWS:
    raise ValueError(f"the GPU Gram kernel takes blocks with min(m, n) <= {GPU_MAX_ROWS}, "
                     f"got {x.shape[-2:]}")
  if iterate is None:
    blocks = math.prod(x.shape[:-2])
    iterate = "xla" if exact else "whole" if blocks >= WHOLE_MIN_BLOCKS else "kernel"
  if iterate not in ("whole", "kernel", "xla"):
    raise ValueError(f"iterate={iterate!r}: choose 'xla', 'kernel' or 'whole'")
  m_pad = max(16, 1 << (m - 1).bit_length())
  tn = tile_n or (64 if exact else 256 if iterate == "whole" else 128)
  xb, undo = _as_blocks(x.astype(dtype), m_pad, tn)
  B, _, n_pad = xb.shape
  nt = n_pad // tn
  splits = 1 if iterate == "whole" else splits or _gpu_splits(B, nt)
  if nt % splits:
    raise ValueError(f"splits={splits} does not divide the {nt} column tiles")
  params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  cols = nt // splits * tn

  poly = functools.partial(gram_matrix_polynomial, steps=steps, coeffs=coeffs, eps=eps,
                           dot=_iterate_dot(iterate_precision, exact))
  iterate_params = pltriton.CompilerParams(num_warps=iterate_warps, num_stages=num_stages)

  if iterate == "whole":
    return undo(_whole_call(xb, poly, tn, exact, iterate_params, interpret)).astype(out_dtype)

  partial = pl.pallas_call(
      functools.partial(_gram_kernel, tn=tn, exact=exact),
      grid=(B, splits),
      in_specs=[pl.BlockSpec((None, m_pad, cols), lambda b, s: (b, 0, s))],
      out_specs=pl.BlockSpec((None, None, m_pad, m_pad), lambda b, s: (b, s, 0, 0)),
      out_shape=_out_struct((B, splits, m_pad, m_pad), _F32, xb),
      compiler_params=params,
      interpret=interpret,
  )(xb)

  if iterate == "kernel":
    q = pl.pallas_call(
        functools.partial(_poly_kernel, poly=poly),
        grid=(B,),
        in_specs=[pl.BlockSpec((None, splits, m_pad, m_pad), lambda b: (b, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, m_pad, m_pad), lambda b: (b, 0, 0)),
        out_shape=_out_struct((B, m_pad, m_pad), _F32, xb),
        compiler_params=iterate_params,
        interpret=interpret,
    )(partial)
  else:
    q = jax.vmap(poly)(jnp.sum(partial, axis=1))

  apply_tiles = apply_tiles or _gpu_apply_tiles(B, nt)
  if nt % apply_tiles:
    raise ValueError(f"apply_tiles={apply_tiles} does not divide the {nt} column tiles")
  x_spec = pl.BlockSpec((None, m_pad, apply_tiles * tn), lambda b, j: (b, 0, j))
  out = pl.pallas_call(
      functools.partial(_apply_kernel, tn=tn, exact=exact),
      grid=(B, nt // apply_tiles),
      in_specs=[pl.BlockSpec((None, m_pad, m_pad), lambda b, j: (b, 0, 0)), x_spec],
      out_specs=x_spec,
      out_shape=_out_struct(xb.shape, dtype, xb),
      compiler_params=params,
      interpret=interpret,
  )(q, xb)
  return undo(out).astype(out_dtype)

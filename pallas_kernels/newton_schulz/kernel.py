"""Pallas kernels for the Gram form of Newton-Schulz (see `gram.py` for the maths).

The same three stages (Gram matrix, [m, m] polynomial, final product) in two layouts:

- "whole", one kernel, grid = (blocks,): a program forms X X^T tile by tile, runs the [m, m]
  iteration and writes q @ X. On TPU (Mosaic) the block [m, n] sits in VMEM (Pallas
  double-buffers it across the grid), so X is read from HBM once: one read and one write,
  the least traffic there is. VMEM holds 2 input + 2 output blocks, so a block must stay
  under ~10 MB (128 x 16384 bf16 is 4 MB). On GPU (Pallas Triton) X stays in HBM and the
  program reads it twice (one SM has 256 KB of registers: no block stays resident); this
  is the bf16 default from 64 blocks.
- "split", GPU only: a Gram kernel, grid = (blocks, splits), sums X X^T over its columns in
  float32 registers; the iteration runs in its own kernel (or fused at the end of a
  one-split Gram kernel, or in XLA); an apply kernel, grid = (blocks, n / (4 tiles)), writes
  q @ X over the whole GPU. With few blocks this fills the SMs that one program per block
  would leave idle. float32 inputs iterate in XLA (`newton_schulz_gpu` says why).
  On the H200 "whole" is the fastest layout at K3's per-head blocks, then split with the
  iteration fused, then in its own kernel (benchmarks/results/newton_schulz.md). The GPU
  path takes m <= 128.

Why Triton rather than Mosaic GPU: the work is two short streaming loops of small
(m x 128) matmuls whose tiles Triton lays out, pipelines and feeds to the tensor cores from
`jnp` code; Mosaic GPU would need hand-written TMA/wgmma pipelines and warpgroup layouts
for the same result. Pallas Triton is deprecated as of jax 0.11.2 but works there (run on
the H200) and lowers on jax 0.10.2; passing `pltriton.CompilerParams` selects it (jax's
default GPU backend for `pallas_call` is Mosaic GPU).

Arithmetic (both layouts, and interpret mode, which runs the same kernel bodies on a CPU):
float32 inputs use float32 matmuls at HIGHEST precision throughout; bf16 inputs use bf16
operands with float32 accumulation for X X^T and q @ X (q split into bf16 hi + lo), and
the [m, m] iteration accumulates in float32 (TPU: HIGHEST; GPU: fp16 operands for bf16
inputs, or bf16x3, see GPU_ITERATE).

Padding (inside the wrapper, zeros): rows to the layout's multiple (zero rows of X give zero
rows and columns of the Gram matrix, so they never mix into the real rows), columns to a
multiple of the column tile (zero columns add nothing to X X^T); both are sliced off.
"""

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
WHOLE_MIN_BLOCKS = 64  # one program per block ("whole") from this many blocks
# The GPU kernels' [m, m] iteration for bf16 inputs: the operands of its 17 products
# (float32 accumulation either way). fp16 keeps tf32's 10 mantissa bits at the bf16
# tensor-core rate, twice tf32's, and its range suffices: the Gram matrix is normalized
# (entries <= 1) and q's entries stay below the polynomial's largest gain, a^steps ~ 500.
# On the H200 fp16 is the fastest, with tf32's errors; bf16x3 is slower but far closer to
# the float32 reference on ill-conditioned blocks, where fp16's error is about plain XLA's
# bf16 (benchmarks/results/newton_schulz.md).
GPU_ITERATE = {"fp16": jnp.float16,
               "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3}


def _out_struct(shape, dtype, like):
  """A ShapeDtypeStruct that varies over the same shard_map axes as `like` (Pallas needs
  this under shard_map; the keyword is `manual_axis_type` in jax 0.10 and 0.11, `vma`
  in older versions)."""
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
  """One block: x_ref, o_ref [m, n] (VMEM on TPU, HBM on GPU)."""
  nt = x_ref.shape[1] // tn
  q = poly(_gram_tiles(x_ref, 0, nt, tn, exact))
  _apply_tiles(_apply_operands(q, exact), x_ref, o_ref, tn, exact)


def _gram_kernel(x_ref, g_ref, *, tn, exact, poly=None):
  """One (block, split): x_ref [m, k * tn] columns of the block; g_ref [m, m] float32, the
  partial Gram matrix, or with `poly` (one split) the block's polynomial q."""
  gram = _gram_tiles(x_ref, 0, x_ref.shape[1] // tn, tn, exact)
  g_ref[...] = gram if poly is None else poly(gram)


def _poly_kernel(g_ref, q_ref, *, poly):
  """One block: g_ref [splits, m, m] partial Gram matrices; q_ref [m, m] its polynomial."""
  gram = g_ref[0]
  for s in range(1, g_ref.shape[0]):
    gram += g_ref[s]
  q_ref[...] = poly(gram)


def _apply_kernel(q_ref, x_ref, o_ref, *, tn, exact):
  """q_ref [m, m] float32; x_ref and o_ref [m, k * tn], k column tiles of one block."""
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
  """float32 and bf16 run as they are; other float dtypes run in float32."""
  return x.dtype if x.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32


def _tpu_layout(shape, dtype, tile_n=512):
  """(rows, column tile, columns) of a padded block of the fused TPU kernel: rows in whole
  (8, 128) float32 / (16, 128) bf16 tiles, columns a multiple of the tile (<= tile_n)."""
  m, n = sorted(shape[-2:])
  tn = min(tile_n, _round_up(n, 128))
  return _round_up(m, 16 if dtype == jnp.bfloat16 else 8), tn, _round_up(n, tn)


def tpu_block_bytes(shape, dtype, tile_n=512):
  """Bytes of one padded block of the fused TPU kernel (dtypes other than bf16 as float32)."""
  dtype = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
  m_pad, _, n_pad = _tpu_layout(shape, dtype, tile_n)
  return m_pad * n_pad * jnp.dtype(dtype).itemsize


def newton_schulz_tpu(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, interpret=False, tile_n=512):
  """The fused Mosaic kernel. x: [..., m, n] -> [..., m, n] in x's dtype.

  Rows are padded to whole sublane tiles (8 float32, 16 bf16), columns to a multiple of the
  column tile (min(tile_n, n rounded up to 128); tile_n a multiple of 128).
  """
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
  """Column splits of the Gram kernel: the smallest divisor of num_tiles that gives at least
  GPU_TARGET_PROGRAMS programs (or num_tiles)."""
  want = max(1, math.ceil(GPU_TARGET_PROGRAMS / num_blocks))
  return next((d for d in range(1, num_tiles + 1) if num_tiles % d == 0 and d >= want),
              num_tiles)


def _gpu_apply_tiles(num_blocks, num_tiles, most=4):
  """Column tiles per apply program (q is loaded once per program): the largest divisor of
  num_tiles up to `most` that leaves at least GPU_TARGET_PROGRAMS programs (or 1)."""
  fits = [d for d in range(1, most + 1)
          if num_tiles % d == 0 and num_blocks * num_tiles // d >= GPU_TARGET_PROGRAMS]
  return max(fits, default=1)


def newton_schulz_gpu(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, interpret=False, tile_n=None,
                      splits=None, apply_tiles=None, iterate=None, iterate_precision=None,
                      num_warps=4, num_stages=3, iterate_warps=8):
  """The Triton kernels. x: [..., m, n], with min(m, n) <= 128 -> [..., m, n] in x's dtype.

  iterate: where the [m, m] iteration runs, i.e. the kernel layout:
    "whole": one kernel, one program per block: Gram matrix, iteration and q @ X, the TPU
      kernel's layout, X read twice by the same program (it stays in HBM). The bf16
      default from WHOLE_MIN_BLOCKS blocks, the fastest layout there on the H200 with
      either iteration precision (benchmarks/results/newton_schulz.md).
    "fused": at the end of a Gram kernel with one program per block, then an apply kernel
      over the whole GPU.
    "kernel": a Triton kernel of its own, after a Gram kernel split over columns; the bf16
      default for fewer blocks, which would leave most SMs idle in a one-program-per-block
      Gram pass.
    "xla": batched XLA matmuls between the Gram and apply kernels; the float32 default:
      Triton's IEEE float32 dots become unrolled FMA code, and a program of 17 [128, 128]
      products did not finish compiling on the H200 (benchmarks/results/newton_schulz.md).
  iterate_precision: the bf16 iteration's operands, a name of GPU_ITERATE (float32 x
    iterates at HIGHEST), or any jax precision, used as given; default "fp16" (float32
    accumulation): on the H200 about as fast as bf16 operands and more accurate, faster than
    tf32 (Precision.DEFAULT) at the same error, less accurate than "bf16x3" but faster
    (benchmarks/results/newton_schulz.md).

  Rows are padded to a power of two >= 16 (Triton tiles), columns to a multiple of the tile
  (tile_n, default 64 for float32, 256 for bf16 "whole", 128 otherwise). splits: column
  splits of the Gram kernel; apply_tiles: column tiles per apply program (defaults fill the
  GPU, see `_gpu_splits`).
  """
  out_dtype, dtype = x.dtype, _compute_dtype(x)
  exact = dtype == _F32
  m, n = sorted(x.shape[-2:])
  if m > GPU_MAX_ROWS:
    raise ValueError(f"the GPU Gram kernel takes blocks with min(m, n) <= {GPU_MAX_ROWS}, "
                     f"got {x.shape[-2:]}")
  if iterate is None:  # float32: Triton's IEEE dots unroll into FMA code too long to compile
    blocks = math.prod(x.shape[:-2])
    iterate = "xla" if exact else "whole" if blocks >= WHOLE_MIN_BLOCKS else "kernel"
  m_pad = max(16, 1 << (m - 1).bit_length())
  tn = tile_n or (64 if exact else 256 if iterate == "whole" else 128)
  xb, undo = _as_blocks(x.astype(dtype), m_pad, tn)
  B, _, n_pad = xb.shape
  nt = n_pad // tn
  splits = 1 if iterate in ("fused", "whole") else splits or _gpu_splits(B, nt)
  if nt % splits:
    raise ValueError(f"splits={splits} does not divide the {nt} column tiles")
  params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  cols = nt // splits * tn

  if iterate_precision is None or iterate_precision in GPU_ITERATE:
    # a name sets the bf16 iteration; float32 inputs iterate at HIGHEST
    iterate_precision = _HI if exact else GPU_ITERATE[iterate_precision or "fp16"]
  if isinstance(iterate_precision, type):  # an operand dtype (fp16), float32 accumulation
    operand = iterate_precision
    dot = lambda u, v: jnp.matmul(u.astype(operand), v.astype(operand),
                                  preferred_element_type=_F32)
  else:
    dot = lambda u, v: jnp.matmul(u, v, precision=iterate_precision,
                                  preferred_element_type=_F32)
  poly = functools.partial(gram_matrix_polynomial, steps=steps, coeffs=coeffs, eps=eps, dot=dot)
  iterate_params = pltriton.CompilerParams(num_warps=iterate_warps, num_stages=num_stages)

  if iterate == "whole":
    spec = pl.BlockSpec((None, m_pad, n_pad), lambda b: (b, 0, 0))
    out = pl.pallas_call(
        functools.partial(_whole_kernel, tn=tn, exact=exact, poly=poly),
        grid=(B,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=_out_struct(xb.shape, dtype, xb),
        compiler_params=iterate_params,
        interpret=interpret,
    )(xb)
    return undo(out).astype(out_dtype)

  partial = pl.pallas_call(
      functools.partial(_gram_kernel, tn=tn, exact=exact,
                        poly=poly if iterate == "fused" else None),
      grid=(B, splits),
      in_specs=[pl.BlockSpec((None, m_pad, cols), lambda b, s: (b, 0, s))],
      out_specs=pl.BlockSpec((None, None, m_pad, m_pad), lambda b, s: (b, s, 0, 0)),
      out_shape=_out_struct((B, splits, m_pad, m_pad), _F32, xb),
      compiler_params=iterate_params if iterate == "fused" else params,
      interpret=interpret,
  )(xb)

  if iterate == "fused":
    q = partial[:, 0]
  elif iterate == "kernel":
    q = pl.pallas_call(
        functools.partial(_poly_kernel, poly=poly),
        grid=(B,),
        in_specs=[pl.BlockSpec((None, splits, m_pad, m_pad), lambda b: (b, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, m_pad, m_pad), lambda b: (b, 0, 0)),
        out_shape=_out_struct((B, m_pad, m_pad), _F32, xb),
        compiler_params=iterate_params,
        interpret=interpret,
    )(partial)
  elif iterate == "xla":
    q = jax.vmap(poly)(jnp.sum(partial, axis=1))  # [B, m_pad, m_pad]
  else:
    raise ValueError(f"iterate={iterate!r}: choose 'xla', 'kernel', 'fused' or 'whole'")

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

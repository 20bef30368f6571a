"""Newton-Schulz orthogonalization for Muon (K3_SPEC 5): `newton_schulz` dispatches to a
backend; all share one contract (see `newton_schulz`).

Modules: `reference.py` (standard form: the float32 oracle and the plain-XLA form), `gram.py`
(the Gram form's maths and its plain-XLA version), `kernel.py` (Pallas: fused Mosaic TPU
kernel, split Triton GPU kernels).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.newton_schulz.gram import gram_matrix_polynomial, newton_schulz_gram_xla
from pallas_kernels.newton_schulz.kernel import (GPU_ITERATE, GPU_MAX_ROWS, TPU_MAX_BLOCK_BYTES,
                                                 newton_schulz_gpu, newton_schulz_tpu,
                                                 tpu_block_bytes)
from pallas_kernels.newton_schulz.reference import (COEFFS, EPS, STEPS, newton_schulz_reference,
                                                    newton_schulz_xla)

__all__ = ["BACKENDS", "COEFFS", "GPU_ITERATE", "gram_matrix_polynomial", "newton_schulz",
           "newton_schulz_gpu", "newton_schulz_gram_xla", "newton_schulz_reference",
           "newton_schulz_tpu", "newton_schulz_xla", "tpu_block_bytes", "uses_gram_kernel"]

BACKENDS = ("auto", "xla", "gram_xla", "pallas", "interpret")
GRAM_MAX_ROWS = 128  # auto: the Gram kernel for blocks with min(m, n) <= 128 ...
GRAM_MIN_ASPECT = 4  # ... and max(m, n) >= 4 min(m, n)


def uses_gram_kernel(shape, dtype="float32"):
  """The rule of backend="auto" on TPU and GPU: the Gram kernel for short-wide blocks,
  min(m, n) <= 128 and max(m, n) >= 4 min(m, n), such as K3's per-head 128 x 7168 Q/K/V
  blocks, that fit the TPU kernel's VMEM budget (max(m, n) <= 40960 bf16 / 20480 float32
  at 128 rows). There X X^T is small: the kernel reads X twice (the standard form ten
  times, and writes it five times) and its [m, m] iteration is cheap. For squarer or larger
  blocks the standard form's large matmuls already run near the matmul peak, while the Gram
  form would add float32 [m, m] work (about 17 m^3-sized products; much slower than XLA on
  the H200: benchmarks/results/newton_schulz.md), so "auto" keeps plain XLA there."""
  m, n = sorted(shape[-2:])
  return (m <= min(GRAM_MAX_ROWS, GPU_MAX_ROWS) and n >= GRAM_MIN_ASPECT * m
          and tpu_block_bytes(shape, dtype) <= TPU_MAX_BLOCK_BYTES)


def newton_schulz(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, backend="auto",
                  gpu_iterate="fp16"):
  """Orthogonalizes every trailing [m, n] block of x by `steps` quintic Newton-Schulz steps.

  Each block is divided by its own Frobenius norm (x / (||x||_F + eps)), transposed inside
  when m > n, iterated X <- a X + (b A + c A A) X with A = X X^T, and transposed back;
  accumulation is float32.

  Args:
    x: [..., m, n] (any leading batch dims, e.g. [layers, heads, m, n]); float32 or bf16
      (other float dtypes compute in float32).
    steps, coeffs, eps: the iteration (K3_SPEC 5 defaults).
    backend:
      "auto": on TPU the Mosaic kernel and on GPU the Triton kernels where
        `uses_gram_kernel(x.shape)`, "xla" otherwise and on every other platform. The choice
        is made when the program is lowered (`jax.lax.platform_dependent`), so AOT lowering
        for another platform picks that platform's path.
      "xla": the standard form in plain XLA (`newton_schulz_xla`: bf16 stays bf16 as in
        optax; the reference itself for float32 x).
      "gram_xla": the Gram form in plain XLA.
      "pallas": force the kernel of the lowering platform (TPU: Mosaic, GPU: Triton, others:
        the TPU kernel in interpret mode). Blocks a kernel cannot take (GPU: min(m, n) > 128;
        TPU: a block over TPU_MAX_BLOCK_BYTES) run "gram_xla" on that platform instead: all
        platforms' branches are traced, so none may raise.
      "interpret": the TPU kernel in Pallas interpret mode (for CPU tests).
    gpu_iterate: the GPU kernels' [m, m] iteration for bf16 x, a name of GPU_ITERATE:
      "fp16" (fp16 operands: tf32's precision at twice its rate) or "bf16x3" (much closer
      to the float32 polynomial on ill-conditioned blocks, but slower:
      benchmarks/results/newton_schulz.md). TPU iterates in float32; float32 x too.
  Returns:
    [..., m, n] in x's dtype.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown Newton-Schulz backend {backend!r}; choose one of {BACKENDS}")
  if gpu_iterate not in GPU_ITERATE:
    raise ValueError(f"unknown gpu_iterate {gpu_iterate!r}; choose one of {tuple(GPU_ITERATE)}")
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n] blocks, got shape {x.shape}")
  kw = dict(steps=steps, coeffs=coeffs, eps=eps)
  xla = functools.partial(newton_schulz_xla, **kw)
  if backend == "xla":
    return xla(x)
  gram_xla = functools.partial(newton_schulz_gram_xla, **kw)
  if backend == "gram_xla":
    return gram_xla(x)
  tpu = functools.partial(newton_schulz_tpu, **kw)
  if backend == "interpret":
    return tpu(x, interpret=True)
  tpu_fits = tpu_block_bytes(x.shape, x.dtype) <= TPU_MAX_BLOCK_BYTES
  interpreted = functools.partial(tpu, interpret=True) if tpu_fits else gram_xla
  tpu = tpu if tpu_fits else gram_xla
  gpu = functools.partial(newton_schulz_gpu, **kw, iterate_precision=gpu_iterate)
  gpu = gpu if min(x.shape[-2:]) <= GPU_MAX_ROWS else gram_xla
  if backend == "pallas":
    return jax.lax.platform_dependent(x, tpu=tpu, cuda=gpu, default=interpreted)
  if not uses_gram_kernel(x.shape, x.dtype):
    return xla(x)
  return jax.lax.platform_dependent(x, tpu=tpu, cuda=gpu, default=xla)

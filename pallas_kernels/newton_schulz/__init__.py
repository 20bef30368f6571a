"""Newton-Schulz orthogonalization for Muon (K3_SPEC 5): `newton_schulz` dispatches to a
backend: "reference" (`reference.py`, the standard form), "gram_reference" (`gram.py`, the
Gram form in plain JAX), "kernel" (`kernel.py`, Pallas), "symmetric" (`symmetric.py`, the
standard form's symmetric products on Mosaic GPU)."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.backends import check_backend
from pallas_kernels.newton_schulz import symmetric
from pallas_kernels.newton_schulz.gram import gram_matrix_polynomial, newton_schulz_gram_xla
from pallas_kernels.newton_schulz.kernel import (GPU_ITERATE, GPU_MAX_ROWS, TPU_MAX_BLOCK_BYTES,
                                                 newton_schulz_gpu, newton_schulz_tpu,
                                                 tpu_block_bytes)
from pallas_kernels.newton_schulz.reference import (COEFFS, EPS, STEPS, newton_schulz_reference,
                                                    newton_schulz_xla)
from pallas_kernels.newton_schulz.symmetric import newton_schulz_symmetric

__all__ = ["BACKENDS", "COEFFS", "GPU_ITERATE", "RENAMED", "gram_matrix_polynomial",
           "newton_schulz", "newton_schulz_gpu", "newton_schulz_gram_xla",
           "newton_schulz_reference", "newton_schulz_symmetric", "newton_schulz_tpu",
           "newton_schulz_xla", "tpu_block_bytes", "uses_gram_kernel"]

BACKENDS = ("reference", "gram_reference", "kernel", "interpret", "symmetric", "auto")
RENAMED = {"xla": "reference", "gram_xla": "gram_reference", "pallas": "kernel"}  # old: new
GRAM_MAX_ROWS = 128
GRAM_MIN_ASPECT = 4


def uses_gram_kernel(shape, dtype="float32"):
  """backend="auto"'s rule: the Gram kernel for short-wide blocks that fit, reading X twice,
  not ten times; squarer blocks keep "reference" (plain XLA), whose big matmuls run near
  peak."""
  m, n = sorted(shape[-2:])
  return (m <= min(GRAM_MAX_ROWS, GPU_MAX_ROWS) and n >= GRAM_MIN_ASPECT * m
          and tpu_block_bytes(shape, dtype) <= TPU_MAX_BLOCK_BYTES)


def newton_schulz(x, *, steps=STEPS, coeffs=COEFFS, eps=EPS, backend="auto",
                  gpu_iterate="fp16"):
  """Orthogonalizes each trailing [m, n] block of x (as `reference.py`), in x's dtype.
  backend "kernel": the lowering platform's kernel (the TPU one interpreted elsewhere),
  "gram_reference" for blocks it cannot take (every platform's branch is traced);
  "interpret": the TPU kernel interpreted; "symmetric": on CUDA `newton_schulz_symmetric`
  for bf16 blocks whose short side is a multiple of 256 ("reference" on other platforms),
  other blocks as "auto"; "auto": the kernel where `uses_gram_kernel`, else "reference",
  chosen at lowering. gpu_iterate: a GPU_ITERATE name."""
  check_backend("Newton-Schulz", backend, BACKENDS, RENAMED)
  if gpu_iterate not in GPU_ITERATE:
    raise ValueError(f"unknown gpu_iterate {gpu_iterate!r}; choose one of {tuple(GPU_ITERATE)}")
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs [..., m, n] blocks, got shape {x.shape}")
  kw = dict(steps=steps, coeffs=coeffs, eps=eps)
  reference = functools.partial(newton_schulz_xla, **kw)
  if backend == "reference":
    return reference(x)
  gram = functools.partial(newton_schulz_gram_xla, **kw)
  if backend == "gram_reference":
    return gram(x)
  if backend == "symmetric" and symmetric.fits(x.shape, x.dtype):
    sym = functools.partial(newton_schulz_symmetric, **kw)
    return jax.lax.platform_dependent(x, cuda=sym, default=reference)
  tpu = functools.partial(newton_schulz_tpu, **kw)
  if backend == "interpret":
    return tpu(x, interpret=True)
  tpu_fits = tpu_block_bytes(x.shape, x.dtype) <= TPU_MAX_BLOCK_BYTES
  interpreted = functools.partial(tpu, interpret=True) if tpu_fits else gram
  tpu = tpu if tpu_fits else gram
  gpu = functools.partial(newton_schulz_gpu, **kw, iterate_precision=gpu_iterate)
  gpu = gpu if min(x.shape[-2:]) <= GPU_MAX_ROWS else gram
  if backend == "kernel":
    return jax.lax.platform_dependent(x, tpu=tpu, cuda=gpu, default=interpreted)
  if not uses_gram_kernel(x.shape, x.dtype):
    return reference(x)
  return jax.lax.platform_dependent(x, tpu=tpu, cuda=gpu, default=reference)

"""Grouped matmul, the experts of a dropless MoE: rows sorted by group, each group times its
own matrix (`reference.gmm`), differentiable in both operands.

`grouped_matmul(lhs, rhs, group_sizes, backend=)` dispatches to:
  "reference"  plain JAX (`jax.lax.ragged_dot`; on TPU XLA's grouped-matmul kernels);
  "kernel"     Pallas Mosaic GPU kernels (`kernel.py`: ours for the forward and the lhs
               gradient, JAX's library one for the weight gradient; H100 / H200);
  "kernel_ws"  the warp-specialized Mosaic GPU kernels (`kernel_ws.gmm_ws`, `kernel_ws.tgmm_ws`)
               for all three products;
  "auto"       on GPU the first of "kernel_ws", "kernel" whose tiles the operands fit, else
               "reference"; "reference" elsewhere.
Its VJP is two more grouped products of the same backend: dlhs = gmm(dout, rhs^T) and
drhs = tgmm(lhs, dout) (per group lhs^T dout). Imports nothing from `k3jax/`.
"""

from __future__ import annotations

import functools
import types

import jax
import numpy as np

from pallas_kernels.grouped_matmul import kernel, kernel_ws, reference
from pallas_kernels.platform import target_platform
from pallas_kernels.shard_types import cotangent_like

__all__ = ["BACKENDS", "grouped_matmul", "resolve_backend"]

BACKENDS = ("reference", "kernel", "kernel_ws", "auto")
_PRODUCTS = {"reference": reference, "kernel": kernel,
             "kernel_ws": types.SimpleNamespace(gmm=kernel_ws.gmm_ws, tgmm=kernel_ws.tgmm_ws)}
# the GPU kernels, fastest first (benchmarks/results/moe.md): what "auto" tries in turn
_CHECKS = {"kernel_ws": kernel_ws.check_ws, "kernel": kernel.check}


def resolve_backend(backend: str, platform: str, lhs=None, rhs=None) -> str:
  """The backend `backend` stands for on platform ("gpu", "tpu", "cpu"). "auto" on GPU is
  the first of "kernel_ws", "kernel" whose tiles the operands (arrays or ShapeDtypeStructs,
  lhs [M, K], rhs [G, K, N]; both or neither) fit, else "reference"; elsewhere
  "reference". The others are returned unchanged, "kernel" and "kernel_ws" after their
  check of the operands (ValueError naming what does not fit)."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown grouped-matmul backend {backend!r}; choose one of {BACKENDS}")
  if backend != "auto":
    if backend in _CHECKS and lhs is not None:
      _CHECKS[backend](lhs, rhs)
    return backend
  if platform != "gpu":
    return "reference"
  if lhs is None:
    return next(iter(_CHECKS))
  for candidate, check in _CHECKS.items():
    try:
      check(lhs, rhs)
      return candidate
    except ValueError:
      pass  # shapes or dtypes its tiles do not divide (small models)
  return "reference"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   backend: str = "auto", platform: str | None = None) -> jax.Array:
  """out[i] = lhs[i] @ rhs[g(i)] for rows sorted by group; zero for rows past the groups.

  lhs [M, K]; rhs [G, K, N]; group_sizes [G] int (rows per group, in order, summing to at
  most M). platform: what the program is compiled for (None: the default backend's).
  Returns [M, N] in lhs.dtype, accumulated in fp32.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"grouped_matmul takes lhs [M, K] and rhs [G, K, N], got {lhs.shape} "
                     f"and {rhs.shape}")
  if group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"group_sizes {group_sizes.shape} must be [G] for rhs {rhs.shape}")
  resolved = resolve_backend(backend, target_platform(None, platform), lhs, rhs)
  return _gmm(resolved, lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(backend, lhs, rhs, group_sizes):
  return _PRODUCTS[backend].gmm(lhs, rhs, group_sizes)


def _gmm_fwd(backend, lhs, rhs, group_sizes):
  return _gmm(backend, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(backend, res, dout):
  lhs, rhs, group_sizes = res
  products = _PRODUCTS[backend]
  dout = dout.astype(lhs.dtype)
  dlhs = products.gmm(dout, rhs, group_sizes, transpose_rhs=True)
  drhs = products.tgmm(lhs, dout, group_sizes).astype(rhs.dtype)
  # under shard_map: summed over the axes the rows vary over and the weights do not
  return (cotangent_like(dlhs, lhs), cotangent_like(drhs, rhs),
          np.zeros(group_sizes.shape, jax.dtypes.float0))


_gmm.defvjp(_gmm_fwd, _gmm_bwd)

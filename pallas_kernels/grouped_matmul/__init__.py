"""Grouped matmul for a dropless MoE's experts: rows sorted by group, each group times its
own matrix; VJP dlhs = gmm(dout, rhs^T), drhs = tgmm(lhs, dout) on the same backend.
Backends: "reference" (`jax.lax.ragged_dot`), "kernel" (`kernel.py`), "kernel_ws"
(`kernel_ws.py`), "auto" (on GPU the first of those two that fits, else "reference")."""

from __future__ import annotations

import functools
import types

import jax
import numpy as np

from pallas_kernels.backends import check_backend
from pallas_kernels.grouped_matmul import kernel, kernel_ws, reference
from pallas_kernels.platform import lowered_once, target_platform
from pallas_kernels.shard_types import cotangent_like

__all__ = ["BACKENDS", "grouped_matmul", "resolve_backend"]

BACKENDS = ("reference", "kernel", "kernel_ws", "auto")


def _lowered_once(gmm, tgmm) -> types.SimpleNamespace:
  """The kernels as `lowered_once` functions."""
  return types.SimpleNamespace(gmm=lowered_once(static_argnames="transpose_rhs")(gmm),
                               tgmm=lowered_once()(tgmm))


_PRODUCTS = {"reference": reference, "kernel": _lowered_once(kernel.gmm, kernel.tgmm),
             "kernel_ws": _lowered_once(kernel_ws.gmm_ws, kernel_ws.tgmm_ws)}
# the GPU kernels, fastest first (benchmarks/results/moe.md): what "auto" tries in turn
_CHECKS = {"kernel_ws": kernel_ws.check_ws, "kernel": kernel.check}


def resolve_backend(backend: str, platform: str, lhs=None, rhs=None) -> str:
  """`backend` on platform; lhs, rhs (or None) checked against the kernels' tiles."""
  check_backend("grouped-matmul", backend, BACKENDS)
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
      pass
  return "reference"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   backend: str = "auto", platform: str | None = None) -> jax.Array:
  """out[i] = lhs[i] @ rhs[g(i)], zero past the groups: lhs [M, K], rhs [G, K, N],
  group_sizes [G] -> [M, N] in lhs.dtype, fp32 accumulation."""
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

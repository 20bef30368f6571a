"""Building blocks every K3 layer uses: parameters with logical axes, Dense, RMSNorm.

Parameters live in `param_dtype`, cast to `dtype` where used. Optimizer metadata (K3_SPEC 5):
`muon` ("matrix", "router"; absent: AdamW), `muon_roles` per axis ("in", "out", "expert",
"head"); `compute_dtype` / `compute_quant` ("mxfp4"): how every use sees a parameter."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.axes import AxisNames
from k3jax.model import mxfp4

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


MUON_KINDS = ("matrix", "router")
MUON_ROLES = ("in", "out", "expert", "head")


def param(rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int], axes: AxisNames,
          dtype=jnp.float32, *, muon: str | None = None,
          muon_roles: Sequence[str] | None = None, compute_dtype=None,
          compute_quant: str | None = None) -> nnx.Param:
  """An `nnx.Param` with logical axes `axes` and optimizer metadata (module docstring)."""
  if len(axes) != len(shape):
    raise ValueError(f"param: axes {axes} do not match shape {tuple(shape)}")
  meta = {}
  if muon is not None:
    roles = tuple(muon_roles or ())
    if muon not in MUON_KINDS or len(roles) != len(shape) or not set(roles) <= set(MUON_ROLES):
      raise ValueError(f"param: muon={muon!r} needs one role of {MUON_ROLES} per axis of "
                       f"{tuple(shape)}, got {roles}")
    if "in" not in roles or "out" not in roles:
      raise ValueError(f"param: a Muon matrix needs 'in' and 'out' axes, got {roles}")
    meta = dict(muon=muon, muon_roles=roles)
  if compute_dtype is not None and jnp.dtype(compute_dtype) != jnp.dtype(dtype):
    meta["compute_dtype"] = jnp.dtype(compute_dtype).name
  if compute_quant is not None:
    meta["compute_quant"] = compute_quant
  key = rngs.params() if rngs is not None else jax.random.key(0)
  return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(axes),
                   eager_sharding=False, **meta)


@dataclasses.dataclass(frozen=True)
class ComputeView:
  """How every use of a parameter sees it (its `compute_quant`, then `compute_dtype`):
  the model applies it in its forward, `train.cast_params_once` once per step."""
  dtype: str = ""
  quant: str = ""

  def __bool__(self) -> bool:
    return bool(self.dtype or self.quant)

  def __call__(self, p: jax.Array) -> jax.Array:
    if self.quant == "mxfp4":
      p = mxfp4.fake_quantize(p, axis=-2)
    return p.astype(self.dtype) if self.dtype else p


def compute_views(abstract_params) -> Any:
  """`ComputeView` per leaf of `nnx.state(model, nnx.Param)` (only metadata is read); None
  when no parameter has one (a model without routed experts: nothing to prepare)."""
  def view(v):
    meta = v.get_metadata()
    return ComputeView(meta.get("compute_dtype", ""), meta.get("compute_quant", ""))
  views = jax.tree.map(view, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return views if any(jax.tree.leaves(views)) else None


def normal(std: float) -> Initializer:
  return nnx.initializers.truncated_normal(stddev=std)


def ones(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)


class Dense(nnx.Module):
  """y = x W, contracting the trailing `in_shape` dims of x into `out_shape`.
  W: [*in_shape, *out_shape] with logical names `axes`, init N(0, 1/fan_in) truncated.
  muon: "matrix" (default), "per_head" (one block per "heads" entry), "router" or None."""

  def __init__(self, in_shape: int | Sequence[int], out_shape: int | Sequence[int],
               axes: AxisNames, *, rngs: nnx.Rngs, dtype=jnp.bfloat16,
               param_dtype=jnp.float32, init_std: float | None = None,
               muon: str | None = "matrix"):
    self.in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
    self.out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    fan_in = math.prod(self.in_shape)
    std = fan_in ** -0.5 if init_std is None else init_std
    n_in = len(self.in_shape)
    roles = ["in"] * n_in + ["out"] * len(self.out_shape)
    if muon == "per_head":
      if "heads" not in axes[n_in:]:
        raise ValueError(f"Dense: muon='per_head' needs an output axis named 'heads', got {axes}")
      roles = [r if i < n_in or axes[i] != "heads" else "head" for i, r in enumerate(roles)]
      muon = "matrix"
    self.kernel = param(rngs, normal(std), self.in_shape + self.out_shape, axes, param_dtype,
                        muon=muon, muon_roles=roles if muon else None, compute_dtype=dtype)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_shape)
    if x.shape[x.ndim - n_in:] != self.in_shape:
      raise ValueError(f"Dense expects trailing dims {self.in_shape}, got {x.shape}")
    lead = x.shape[:x.ndim - n_in]
    w = self.kernel[...].astype(self.dtype).reshape(math.prod(self.in_shape), -1)
    y = x.astype(self.dtype).reshape(*lead, -1) @ w
    return y.reshape(*lead, *self.out_shape)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
  """x / rms(x) * weight over the last axis, computed in fp32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned gain (initialised to 1). x: [..., dim]."""

  def __init__(self, dim: int, axis_name: str | None = "embed", *, eps: float = 1e-5,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    self.weight = param(rngs, ones, (dim,), (axis_name,), param_dtype)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)

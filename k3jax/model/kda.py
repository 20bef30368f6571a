"""The Kimi Delta Attention layer (K3_SPEC 2.1): projections, short conv, bounded gate.

The token-mixing recurrence itself lives in `pallas_kernels.kda`; this layer calls its
dispatcher with the backend named in `config.model.kda.backend`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import layers
from k3jax.model import axes
from k3jax.model.axes import constrain
from pallas_kernels import kda as kda_ops


def short_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Depthwise causal convolution that never reads across a document boundary.

  x: [B, T, H, D]; weight: [W, H, D] (tap j multiplies x[t - j]); segment_ids: [B, T].
  Computed in fp32, so that the taps' gradients are fp32 sums over all B x T positions (in
  bf16 they were 1.2% off at 8k positions), and returned in x's dtype: fp32 weights must
  not promote bf16 activations (the recurrence after it would run its matmuls in fp32: its
  chunk backward 16x slower on the H200).
  """
  xf, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
  out = xf * weight[0]
  for j in range(1, weight.shape[0]):
    shifted = jnp.pad(xf, ((0, 0), (j, 0), (0, 0), (0, 0)))[:, :-j]
    same_doc = jnp.pad(segment_ids, ((0, 0), (j, 0)), constant_values=-1)[:, :-j] == segment_ids
    out = out + jnp.where(same_doc[..., None, None], shifted, 0) * weight[j]
  return out.astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum x^2 + eps) over the last axis, in fp32."""
  xf = x.astype(jnp.float32)
  return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def _conv_init(key, shape, dtype):
  bound = 1.0 / math.sqrt(shape[0])  # fan-in of a depthwise tap stack
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def _dt_bias_init(key, shape, dtype):
  # Decay time constants log-uniform in [1e-3, 1e-1], stored through softplus^-1.
  dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nnx.Module):
  """Kimi Delta Attention. x: [B, T, d] (after the pre-norm) -> [B, T, d]."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    c = cfg_model.kda
    d, h, k = cfg_model.d_model, c.num_heads, c.head_dim
    dense = dict(rngs=rngs, dtype=jnp.dtype(cfg_model.dtype),
                 param_dtype=jnp.dtype(cfg_model.param_dtype))
    pdt = jnp.dtype(cfg_model.param_dtype)
    hd = ("embed", "heads", "head_dim")
    self.q_proj = layers.Dense(d, (h, k), hd, muon="per_head", **dense)
    self.k_proj = layers.Dense(d, (h, k), hd, muon="per_head", **dense)
    self.v_proj = layers.Dense(d, (h, k), hd, muon="per_head", **dense)
    conv_axes = ("conv", "heads", "head_dim")
    self.q_conv = layers.param(rngs, _conv_init, (c.conv_size, h, k), conv_axes, pdt)
    self.k_conv = layers.param(rngs, _conv_init, (c.conv_size, h, k), conv_axes, pdt)
    self.v_conv = layers.param(rngs, _conv_init, (c.conv_size, h, k), conv_axes, pdt)
    self.beta_proj = layers.Dense(d, h, ("embed", "heads"), **dense)
    self.f_down = layers.Dense(d, c.gate_rank, ("embed", "gate_rank"), **dense)
    self.f_up = layers.Dense(c.gate_rank, (h, k), ("gate_rank", "heads", "head_dim"), **dense)
    # Bounded gate: A_log starts at 0 (spec); softplus gate: Kimi Linear's A in [1, 16].
    a_init = (layers.zeros if c.gate == "bounded" else
              lambda key, s, t: jnp.log(jax.random.uniform(key, s, t, 1.0, 16.0)))
    self.A_log = layers.param(rngs, a_init, (h,), ("heads",), pdt)
    self.dt_bias = layers.param(rngs, _dt_bias_init, (h, k), ("heads", "head_dim"), pdt)
    self.gate_proj = layers.Dense(d, (h, k), hd, **dense)  # full-rank output gate
    self.o_norm = layers.RMSNorm(k, "head_dim", eps=cfg_model.norm_eps, param_dtype=pdt,
                                 rngs=rngs)
    self.o_proj = layers.Dense((h, k), d, ("heads", "head_dim", "embed"), **dense)
    self.gate_kind, self.lower_bound = c.gate, c.gate_lower_bound
    self.chunk_size, self.backend = c.chunk_size, c.backend

  def decay(self, x: jax.Array) -> jax.Array:
    """Per-channel log-decay g [B, T, H, K] in fp32; in (lower_bound, 0) for the bounded gate."""
    f = self.f_up(self.f_down(x)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    a = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
    if self.gate_kind == "bounded":
      return self.lower_bound * jax.nn.sigmoid(a * f)
    return -a * jax.nn.softplus(f)

  def __call__(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
    """y [B, T, d] and an empty aux (mixers return (y, aux), see `MLA`)."""
    act = ("batch", "seq", "heads", "head_dim")
    q = constrain(jax.nn.silu(short_conv(self.q_proj(x), self.q_conv[...], segment_ids)), act)
    k = constrain(jax.nn.silu(short_conv(self.k_proj(x), self.k_conv[...], segment_ids)), act)
    v = constrain(jax.nn.silu(short_conv(self.v_proj(x), self.v_conv[...], segment_ids)), act)
    q, k = l2_normalize(q).astype(v.dtype), l2_normalize(k).astype(v.dtype)
    beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
    spec = axes.logical_to_spec(act)   # where q/k/v live, for the kernels' shard_map
    o = kda_ops.kda(q, k, v, self.decay(x), beta, segment_ids=segment_ids,
                    backend=self.backend, chunk_size=self.chunk_size or None,
                    mesh=axes.current_mesh(), batch_axis=spec[0], head_axis=spec[2])
    o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(
        self.gate_proj(x).astype(jnp.float32))
    return constrain(self.o_proj(o.astype(x.dtype)), ("batch", "seq", "embed")), {}

"""The Kimi Delta Attention layer (K3_SPEC 2.1): projections, short conv, bounded gate.

The recurrence is `pallas_kernels.kda`, the short conv `pallas_kernels.short_conv`
(backends: `model.kda.backend`, `.conv_backend`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import axes
from k3jax.axes import constrain
from k3jax.model import layers
from k3jax.model.remat import keep
from pallas_kernels import kda as kda_ops
from pallas_kernels import short_conv as conv_ops

# The decoding cache (`init_cache`) split like the activations: rows and heads.
CACHE_AXES = {"conv": ("batch", None, None, "heads", "head_dim"),
              "state": ("batch", "heads", None, None)}


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
    self.gate_proj = layers.Dense(d, (h, k), hd, **dense)
    self.o_norm = layers.RMSNorm(k, "head_dim", eps=cfg_model.norm_eps, param_dtype=pdt,
                                 rngs=rngs)
    self.o_proj = layers.Dense((h, k), d, ("heads", "head_dim", "embed"), **dense)
    self.gate_kind, self.lower_bound = c.gate, c.gate_lower_bound
    self.chunk_size, self.backend = c.chunk_size, c.backend
    self.conv_backend = c.conv_backend

  def decay(self, x: jax.Array) -> jax.Array:
    """Per-channel log-decay g [B, T, H, K] in fp32; in (lower_bound, 0) for the bounded gate."""
    f = self.f_up(self.f_down(x)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    a = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
    if self.gate_kind == "bounded":
      return self.lower_bound * jax.nn.sigmoid(a * f)
    return -a * jax.nn.softplus(f)

  def __call__(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
    """y [B, T, d] and an empty aux (mixers return (y, aux), see `MLA`)."""
    return self._forward(x, segment_ids, False)

  def prefill(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
    """`__call__` that also returns the decoding cache after the prompts."""
    return self._forward(x, segment_ids, True)

  def _forward(self, x, segment_ids, cache: bool):
    act = ("batch", "seq", "heads", "head_dim")
    spec = axes.logical_to_spec(act)   # where q/k/v live, for the kernels' shard_map
    where = dict(mesh=axes.current_mesh(), batch_axis=spec[0], head_axis=spec[2],
                 seq_axis=axes.split_axes("seq"))

    projs = [keep("kda_proj", p(x)) for p in (self.q_proj, self.k_proj, self.v_proj)]

    def conv(proj, weight, normalize):  # silu(short conv), L2-normalized for q and k
      return keep("kda_inputs", constrain(conv_ops.short_conv(
          proj, weight[...], segment_ids, normalize=normalize, backend=self.conv_backend,
          **where), act))

    q, k = conv(projs[0], self.q_conv, True), conv(projs[1], self.k_conv, True)
    v = conv(projs[2], self.v_conv, False)
    beta = keep("kda_inputs", jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32)))
    o = kda_ops.kda(q, k, v, keep("kda_inputs", self.decay(x)), beta, segment_ids=segment_ids,
                    backend=self.backend, chunk_size=self.chunk_size or None,
                    output_final_state=cache, bounded_gate=self.gate_kind == "bounded",
                    **where)
    if cache:
      o, state = o
    o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(
        keep("kda_proj", self.gate_proj(x)).astype(jnp.float32))
    y = constrain(self.o_proj(o.astype(x.dtype)), ("batch", "seq", "embed"))
    if not cache:
      return y, {}
    w = self.q_conv.shape[0]
    tail = jnp.stack(projs, 2)[:, -(w - 1):]                             # [B, <= W-1, 3, H, K]
    tail = jnp.pad(tail, ((0, 0), (w - 1 - tail.shape[1], 0), (0, 0), (0, 0), (0, 0)))
    return y, axes.constrain_each({"conv": tail, "state": state}, CACHE_AXES)

  def init_cache(self, batch: int, dtype) -> dict:
    """{"conv": [B, W - 1, 3, H, K] last q/k/v projections, "state": [B, H, K, K] fp32}."""
    w, h, k = self.q_conv.shape[0], *self.dt_bias.shape
    return axes.constrain_each({"conv": jnp.zeros((batch, w - 1, 3, h, k), dtype),
                                "state": jnp.zeros((batch, h, k, k), jnp.float32)}, CACHE_AXES)

  def step(self, x: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
    """One token a row: x [B, 1, d] -> (y [B, 1, d], the new cache); pos is unused."""
    del pos
    projs = [p(x) for p in (self.q_proj, self.k_proj, self.v_proj)]          # [B, 1, H, K]
    window = jnp.concatenate([cache["conv"], jnp.stack(projs, 2).astype(
        cache["conv"].dtype)], axis=1)                                        # [B, W, 3, H, K]
    ones = jnp.ones(window.shape[:2], jnp.int32)
    q, k, v = (conv_ops.short_conv(window[:, :, j].astype(projs[j].dtype), weight[...], ones,
                                   normalize=j < 2)[:, -1:]
               for j, weight in enumerate((self.q_conv, self.k_conv, self.v_conv)))
    beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
    o, state = kda_ops.kda(q, k, v, self.decay(x), beta, backend="naive",
                           initial_state=cache["state"], output_final_state=True)
    o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(
        self.gate_proj(x).astype(jnp.float32))
    return self.o_proj(o.astype(x.dtype)), {"conv": window[:, 1:], "state": state}

  def write(self, cache: dict, entry: dict, pos: jax.Array, index: tuple = ()) -> dict:
    """`entry` replaces the cache; index: leading (layer) positions."""
    del pos
    return axes.constrain_each({key: cache[key].at[index].set(entry[key].astype(cache[key].dtype))
                                for key in cache}, CACHE_AXES, stacked=len(index))

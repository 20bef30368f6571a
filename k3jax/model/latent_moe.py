"""Stable LatentMoE (K3_SPEC 4): routed SiTU-GLU experts in a latent, shared experts at full width.

  s = sigmoid(x W_r)                      [B, T, E]  fp32 router scores
  T = topk(s + b, k),  p_j = s_j / sum_T s           b: the balancing bias (selection only)
  z = x W_down                            [B, T, latent], projected BEFORE dispatch
  u = sum_{j in T} p_j * routed_scaling * E_j(z)     combined in the latent (fp32)
  y = sum_shared GLU(x) + RMSNorm(u) W_up [B, T, d]

`moe.dispatch` picks how z becomes u (moe_dispatch.py, expert_parallel.py); the train step
sums aux over microbatches and devices and calls `update_balance` once per step."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from k3jax import axes
from k3jax.axes import constrain
from k3jax.model import balancing
from k3jax.model import quantile_balancing as qb
from k3jax.model.expert_parallel import (expert_parallel_dropless_moe, expert_parallel_moe,
                                         experts_split)
from k3jax.model.layers import ComputeView, Dense, RMSNorm, normal, param
from k3jax.model.moe_dispatch import (batched_glu_experts, capacity_moe, dropless_moe,
                                      grouped_kernel_fits, ragged_glu_experts, resolve_dispatch)
from k3jax.model.remat import keep, recomputes_activations
from k3jax.model.situ_glu import GLUMLP, glu_activation
from pallas_kernels.platform import target_platform


def route_per_device(scores: jax.Array, bias: jax.Array, k: int):
  """`qb.route` per device under the mesh (XLA would all-gather scores for top_k)."""
  mesh = axes.current_mesh()
  if mesh is None:
    return qb.route(scores, bias, k)
  # N = B x T flattened: rows split over the batch's mesh axes, then the positions'
  rows = PartitionSpec(axes.mesh_axes("batch") + axes.mesh_axes("seq") or None)
  return jax.shard_map(functools.partial(qb.route, k=k), mesh=mesh,
                       in_specs=(rows, PartitionSpec()), out_specs=rows)(scores, bias)


class LatentMoE(nnx.Module):
  """x [B, T, d], valid [B, T] bool or None -> (y [B, T, d], aux).
  aux: "counts" int32 [E, bins] (QB histogram), "load" int32 [E], "dropped" int32 [],
  "aux_loss" fp32 [] (valid tokens x switch_loss); all sums over tokens."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    e, f = cfg_model.moe, cfg_model.ffn
    d, n_exp, lat, hid = cfg_model.d_model, e.num_experts, e.latent_dim, e.expert_dim
    self.dtype = dtype = jnp.dtype(cfg_model.dtype)
    pdt = jnp.dtype(cfg_model.param_dtype)
    self.num_experts, self.top_k = n_exp, e.top_k
    self.routed_scaling = float(e.routed_scaling)
    self.balancing, self.balance_bins = e.balancing, e.balance_bins
    self.bias_update_speed = float(e.bias_update_speed)
    self.aux_loss_weight = float(e.aux_loss_weight)
    self.balance_cutoff = e.balance_cutoff
    self.dispatch, self.capacity_factor = e.dispatch, float(e.capacity_factor)
    self.gmm_backend, self.token_chunk = e.gmm_backend, int(e.token_chunk)
    # the routed experts' quantization in every forward (train.cast_params_once: in the step)
    self.expert_quant = "" if e.expert_quant == "none" else e.expert_quant
    self.activation, self.b1, self.b2 = f.activation, f.situ_b1, f.situ_b2
    self.recompute = recomputes_activations(cfg_model.remat)

    # The router is stored and applied in fp32 whatever the model dtypes.
    self.router = Dense(d, n_exp, ("embed", "experts"), rngs=rngs, dtype=jnp.float32,
                        param_dtype=jnp.float32, muon="router")
    self.bias = qb.BalanceBias(jnp.zeros((n_exp,), jnp.float32), out_sharding=("experts",),
                               eager_sharding=False)
    expert_matrix = dict(muon="matrix", muon_roles=("expert", "in", "out"), compute_dtype=dtype,
                         compute_quant=self.expert_quant or None)
    self.weights_prepared = False  # True: the step quantized and cast them (cast_params_once)
    self.w_down = Dense(d, lat, ("embed", "latent"), rngs=rngs, dtype=dtype, param_dtype=pdt)
    self.w_g = param(rngs, normal(lat ** -0.5), (n_exp, lat, hid), ("experts", "latent", "mlp"),
                     pdt, **expert_matrix)
    self.w_u = param(rngs, normal(lat ** -0.5), (n_exp, lat, hid), ("experts", "latent", "mlp"),
                     pdt, **expert_matrix)
    self.w_d = param(rngs, normal(hid ** -0.5), (n_exp, hid, lat), ("experts", "mlp", "latent"),
                     pdt, **expert_matrix)
    self.latent_norm = RMSNorm(lat, "latent", eps=cfg_model.norm_eps, param_dtype=pdt, rngs=rngs)
    self.w_up = Dense(lat, d, ("latent", "embed"), rngs=rngs, dtype=dtype, param_dtype=pdt)
    self.shared = nnx.List([
        GLUMLP(d, e.shared_dim, activation=f.activation, b1=f.situ_b1, b2=f.situ_b2,
               axes_in="embed", recompute=self.recompute, rngs=rngs, dtype=dtype,
               param_dtype=pdt)
        for _ in range(e.num_shared)])

  def expert_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w_g, w_u [E, latent, hidden], w_d [E, hidden, latent], MXFP4-quantized if asked."""
    quantize = ComputeView(quant="" if self.weights_prepared else self.expert_quant)
    return tuple(quantize(w[...]) for w in (self.w_g, self.w_u, self.w_d))

  def __call__(self, x: jax.Array, valid: jax.Array | None = None):
    b, t, _ = x.shape
    n, k, n_exp = b * t, self.top_k, self.num_experts
    x = constrain(x, ("batch", "seq", "embed"))
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)

    quantile = self.balancing == "quantile"
    with jax.named_scope("router"):
      scores = jax.nn.sigmoid(self.router(x.astype(jnp.float32))).reshape(n, n_exp)  # [N, E]
      biased = self.balancing in ("quantile", "aux_free")
      bias = self.bias[...] if biased else jnp.zeros((n_exp,), jnp.float32)
      idx, weights, alpha = route_per_device(scores, bias, k)  # [N, k], [N, k], [N]
    x = x.astype(self.dtype)

    z = keep("moe_latent", constrain(self.w_down(x), ("batch", "seq", "latent")))  # [B, T, L]
    act = glu_activation(self.activation, self.b1, self.b2, self.recompute)
    flat_valid = valid.reshape(n)
    w = weights * self.routed_scaling
    mesh = axes.current_mesh()
    platform = target_platform(mesh)
    # devices hold whole rows: where one row's t * k pairs fit the kernel, any device's do
    fits = grouped_kernel_fits(t * k, z.shape[-1], self.w_g.shape[-1], n_exp, self.dtype,
                               self.gmm_backend)
    dispatch = resolve_dispatch(self.dispatch, platform, fits, experts_split(mesh))
    if self.token_chunk and dispatch not in ("dropless", "expert_parallel_dropless"):
      raise ValueError(f"moe.token_chunk={self.token_chunk} needs a dropless dispatch; "
                       f"moe.dispatch={self.dispatch!r} is {dispatch!r} here ({platform}): "
                       "set moe.dispatch to a dropless one or moe.token_chunk=0")
    w_g, w_u, w_d = self.expert_weights()
    u, dropped = self._dispatch(dispatch, platform, z, idx, w, (w_g, w_u, w_d), act,
                                 flat_valid)
    u = constrain(u.reshape(b, t, -1), ("batch", "seq", "latent"))
    y = self.w_up(self.latent_norm(u).astype(self.dtype))
    with jax.named_scope("shared"):
      for mlp in self.shared:
        y = y + mlp(x)
    y = constrain(y, ("batch", "seq", "embed"))

    with jax.named_scope("router"):
      if quantile:
        counts = qb.histogram(scores, alpha, bias, self.balance_bins, flat_valid,
                              cutoff=self.balance_cutoff)
      else:
        counts = jnp.zeros((n_exp, self.balance_bins), jnp.int32)
      load = qb.load_stats(idx, n_exp, flat_valid)["load"]
      aux_loss = jnp.zeros((), jnp.float32)
      if self.balancing == "aux_loss":
        tokens = jnp.sum(flat_valid, dtype=jnp.float32)
        aux_loss = tokens * balancing.switch_loss(scores, idx, flat_valid)
    return y, {"counts": counts, "load": load, "dropped": dropped, "aux_loss": aux_loss}

  def update_balance(self, moe_aux: dict):
    """After an optimizer step, the next bias from the summed aux, in place."""
    if self.balancing == "quantile":
      update_bias(self, moe_aux["counts"])
    elif self.balancing == "aux_free":
      self.bias.set_value(balancing.sign_step(self.bias[...], moe_aux["load"],
                                              self.bias_update_speed))

  @jax.named_scope("dispatch")
  def _dispatch(self, dispatch, platform, z, idx, w, experts_w, act, flat_valid):
    """(u [N, L] fp32, dropped pairs) of z [B, T, L] by the resolved `dispatch`."""
    (b, t, _), k, n_exp = z.shape, self.top_k, self.num_experts
    n, (w_g, w_u, w_d) = b * t, experts_w
    if dispatch == "dropless":
      experts = ragged_glu_experts(w_g, w_u, w_d, act, self.dtype, self.gmm_backend, platform)
      u = dropless_moe(z.reshape(n, -1), idx, w, experts, n_exp, self.token_chunk)
      dropped = jnp.zeros((), jnp.int32)
    elif dispatch == "expert_parallel_dropless":
      u = expert_parallel_dropless_moe(z, idx.reshape(b, t, k), w.reshape(b, t, k), w_g, w_u,
                                       w_d, act, self.dtype, self.gmm_backend, platform,
                                       self.token_chunk)
      dropped = jnp.zeros((), jnp.int32)
    else:
      # per row; under context parallelism per device's slice of a row (`slices` of it)
      slices = axes.split_ways("seq")
      capacity = max(1, math.ceil(self.capacity_factor * (t // slices) * k / n_exp))
      if dispatch == "expert_parallel":
        u, kept = expert_parallel_moe(z, idx.reshape(b, t, k), w.reshape(b, t, k), w_g, w_u,
                                      w_d, act, self.dtype, capacity)
      else:
        experts = batched_glu_experts(w_g, w_u, w_d, act, self.dtype)
        u, kept = capacity_moe(z.reshape(n, -1).astype(self.dtype), idx, w, experts, n_exp,
                               b * slices, capacity)
      dropped = jnp.sum(~kept.reshape(n, k) & flat_valid[:, None], dtype=jnp.int32)
    return u, dropped


def update_bias(target: LatentMoE | qb.BalanceBias, counts: jax.Array, k: int | None = None):
  """Replace the balancing bias by `solve_bias` of a step's summed histogram, in place.
  target: a LatentMoE or a BalanceBias (pass k). counts: [E, bins] or [layers, E, bins]
  (stacked, vmapped), summed over microbatches and devices."""
  if isinstance(target, LatentMoE):
    if target.balancing != "quantile":
      return
    var, k = target.bias, target.top_k
  else:
    var = target
    if k is None:
      raise ValueError("update_bias: pass k (top_k) with a bare BalanceBias")
  bias = var[...]
  if counts.ndim == bias.ndim + 1 == 2:
    new = qb.solve_bias(counts, bias, k)
  elif counts.ndim == bias.ndim + 1 == 3:
    new = jax.vmap(qb.solve_bias, in_axes=(0, 0, None))(counts, bias, k)
  else:
    raise ValueError(f"update_bias: counts {counts.shape} do not match bias {bias.shape}")
  # set_value, not var[...] = : flax's [...] compares shardings, which on a tracer builds an
  # error message by walking the whole trace so far (benchmarks/results/compile_time.md)
  var.set_value(new)

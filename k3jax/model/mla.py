"""Gated Multi-head Latent Attention (K3_SPEC 2.2), without positional encoding.

  c_q  = RMSNorm(x W_qa)                       [B, T, q_lora]
  q    = c_q W_qb                              [B, T, H, nope + rope]   per head
  c_kv, k_r = split(x W_kva)                   [B, T, kv_lora], [B, T, rope]
  k_nope, v = split(RMSNorm(c_kv) W_kvb)       [B, T, H, nope], [B, T, H, v]
  k    = [k_nope, k_r]                         k_r is ONE key shared by all heads
  o    = softmax(q k^T / sqrt(nope + rope), causal + document mask) v
  y    = (o * sigmoid(x W_g)) W_o

The absorbed form (`mla.form`) folds W_kvb = [W_uk | W_uv] into the queries and outputs:
q' = [q_nope W_uk^T, q_rope], k' = [c_kv, k_r] (one head), o = softmax(q' k'^T) c_kv W_uv.

The "rope" slot is NoPE (never rotated). For per-head Muon and QK-Clip: `wq_b.kernel`
[q_lora, H, nope + rope], `wkv_b.kernel` [kv_lora, H, nope + v], shared key slot
`wkv_a.kernel[:, kv_lora:]`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import axes
from k3jax.axes import constrain
from k3jax.model.layers import Dense, RMSNorm
from k3jax.model.remat import keep
from pallas_kernels import attention as attention_ops
from pallas_kernels.attention import attention_mask  # noqa: F401  (re-exported: the mask)

BTE = ("batch", "seq", "embed")
BTHD = ("batch", "seq", "heads", "head_dim")
KV = ("batch", "kv_seq", "heads", "head_dim")   # keys and values: all positions of a row
SHARED_KV = ("batch", "kv_seq", None, "head_dim")  # the absorbed form's one key / value "head"
CACHE_AXES = {"latent": ("batch", "cache_seq", None)}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
              scale: float, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Causal + document-masked attention (`pallas_kernels.attention`, per device).
  q: [B, T, H, Dqk]; k: [B, T, H or 1, Dqk]; v: [B, T, H, Dv]; segment_ids: [B, T].
  Returns o [B, T, H, Dv] and each head's max pre-softmax logit [H] fp32 (QK-Clip)."""
  spec = axes.logical_to_spec(BTHD)   # where q/k/v live, for the kernels' shard_map
  return attention_ops.attention(q, k, v, segment_ids, scale=scale, causal=True,
                                 backend=backend, return_max_logit=True,
                                 mesh=axes.current_mesh(), batch_axis=spec[0],
                                 head_axis=spec[2], seq_axis=axes.split_axes("seq"))


class MLA(nnx.Module):
  """Gated MLA layer. x [B, T, d], segment_ids [B, T] int32 -> y [B, T, d] (compute dtype)."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    a = cfg_model.mla
    d, h = cfg_model.d_model, a.num_heads
    dtype, pdtype = jnp.dtype(cfg_model.dtype), jnp.dtype(cfg_model.param_dtype)
    eps = cfg_model.norm_eps
    self.num_heads, self.nope, self.rope, self.v_dim = h, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim
    self.kv_lora = a.kv_lora_rank
    self.scale = (a.qk_nope_dim + a.qk_rope_dim) ** -0.5
    self.backend = a.attention
    self.absorbed = a.form == "absorbed"
    self.dtype = dtype
    dense = dict(rngs=rngs, dtype=dtype, param_dtype=pdtype)
    self.wq_a = Dense(d, a.q_lora_rank, ("embed", "q_lora"), **dense)
    self.q_norm = RMSNorm(a.q_lora_rank, "q_lora", eps=eps, param_dtype=pdtype, rngs=rngs)
    self.wq_b = Dense(a.q_lora_rank, (h, self.nope + self.rope), ("q_lora", "heads", "head_dim"),
                      muon="per_head", **dense)
    self.wkv_a = Dense(d, self.kv_lora + self.rope, ("embed", "kv_lora"), **dense)
    self.kv_norm = RMSNorm(self.kv_lora, "kv_lora", eps=eps, param_dtype=pdtype, rngs=rngs)
    self.wkv_b = Dense(self.kv_lora, (h, self.nope + self.v_dim), ("kv_lora", "heads", "head_dim"),
                       muon="per_head", **dense)
    self.w_g = Dense(d, (h, self.v_dim), ("embed", "heads", "head_dim"), **dense)
    self.w_o = Dense((h, self.v_dim), d, ("heads", "head_dim", "embed"), **dense)

  def _queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both forms' start: q [B, T, H, nope + rope] and x W_kva [B, T, kv_lora + rope]."""
    x = constrain(x.astype(self.dtype), BTE)
    c_q = constrain(self.q_norm(self.wq_a(x)), ("batch", "seq", "q_lora"))
    return keep("mla_proj", constrain(self.wq_b(c_q), BTHD)), self.wkv_a(x)

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k [B, T, H, nope + rope], v [B, T, H, v]; only c_kv and k_r cross devices."""
    q, kv_a = self._queries(x)
    c_kv = constrain(self.kv_norm(kv_a[..., :self.kv_lora]), ("batch", "kv_seq", "kv_lora"))
    k_r = constrain(kv_a[..., self.kv_lora:], ("batch", "kv_seq", "head_dim"))  # [B, T, rope]
    kv = keep("mla_proj", constrain(self.wkv_b(c_kv), KV))               # [B, T, H, nope + v]
    k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
    # shared by the heads; broadcast in fp32 so that its gradient sums the heads in fp32
    k_r = jnp.broadcast_to(k_r.astype(jnp.float32)[:, :, None, :],
                           (*k_r.shape[:2], self.num_heads, self.rope)).astype(k_r.dtype)
    k = constrain(jnp.concatenate([k_nope, k_r], axis=-1), KV)
    return q, k, v

  def project_absorbed(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q' [B, T, H, C + R], k' [B, T, 1, C + R] and values c_kv [B, T, 1, C]."""
    q, kv_a = self._queries(x)
    w_uk = self.wkv_b.kernel[...][..., :self.nope].astype(self.dtype)  # [kv_lora, H, nope]
    q_lat = jnp.einsum("bthn,chn->bthc", q[..., :self.nope], w_uk)
    q = constrain(jnp.concatenate([q_lat, q[..., self.nope:]], axis=-1), BTHD)
    k = self._latent(kv_a)[:, :, None, :]                              # [B, T, 1, C + R]
    return q, constrain(k, SHARED_KV), constrain(k[..., :self.kv_lora], SHARED_KV)

  def _latent(self, kv_a: jax.Array) -> jax.Array:
    """x W_kva [B, T, kv_lora + rope] -> the absorbed form's key [RMSNorm(c_kv), k_r]."""
    c_kv = self.kv_norm(kv_a[..., :self.kv_lora])
    return jnp.concatenate([c_kv, kv_a[..., self.kv_lora:]], axis=-1)

  def heads(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gated per-head outputs before W_o [B, T, H, v], and the max logit per head [H]."""
    if self.absorbed:
      q, k, c_kv = self.project_absorbed(x)
      o, logit_max = attention(q, k, c_kv, segment_ids, self.scale, self.backend)
      w_uv = self.wkv_b.kernel[...][..., self.nope:].astype(self.dtype)  # [kv_lora, H, v]
      o = jnp.einsum("bthc,chv->bthv", o, w_uv)
    else:
      o, logit_max = attention(*self.project(x), segment_ids, self.scale, self.backend)
    o = constrain(o, BTHD)
    gate = jax.nn.sigmoid(keep("mla_proj", self.w_g(x)).astype(jnp.float32))
    return constrain((o.astype(jnp.float32) * gate).astype(self.dtype), BTHD), logit_max

  def __call__(self, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
    """y [B, T, d] and aux {"logit_max": [H]} (the per-head max pre-softmax logit)."""
    heads, logit_max = self.heads(x, segment_ids)
    return constrain(self.w_o(heads), BTE), {"logit_max": logit_max}

  def prefill(self, x: jax.Array, segment_ids: jax.Array, max_len: int
              ) -> tuple[jax.Array, dict]:
    """`__call__` that also returns the decoding cache of `max_len` positions."""
    y, _ = self(x, segment_ids)
    k = self._latent(self.wkv_a(x.astype(self.dtype)))                  # [B, T, C + R]
    latent = jnp.zeros((x.shape[0], max_len, k.shape[-1]), self.dtype)
    return y, axes.constrain_each(
        {"latent": latent.at[:, :x.shape[1]].set(k.astype(self.dtype))}, CACHE_AXES)

  def init_cache(self, batch: int, max_len: int, dtype) -> dict:
    """{"latent": [B, max_len, kv_lora + rope]}: c_kv and the shared key per position."""
    return axes.constrain_each(
        {"latent": jnp.zeros((batch, max_len, self.kv_lora + self.rope), dtype)}, CACHE_AXES)

  def step(self, x: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
    """One token a row at pos [B]: x [B, 1, d] -> (y [B, 1, d], cache entry)."""
    latent = cache["latent"]                                             # [B, L, C + R]
    q, k, _ = self.project_absorbed(x)                     # [B, 1, H, C + R], [B, 1, 1, C + R]
    q, k = q[:, 0].astype(latent.dtype), k[:, 0, 0].astype(latent.dtype)
    scores = jnp.einsum("bhc,blc->bhl", q, latent, preferred_element_type=jnp.float32)
    past = (jnp.arange(latent.shape[1])[None, :] < pos[:, None])[:, None, :]
    own = jnp.einsum("bhc,bc->bh", q, k, preferred_element_type=jnp.float32)[..., None]
    p = jax.nn.softmax(jnp.concatenate([jnp.where(past, scores, -jnp.inf), own], -1) *
                       self.scale, axis=-1)
    o = jnp.einsum("bhl,blc->bhc", p[..., :-1].astype(latent.dtype), latent[..., :self.kv_lora],
                   preferred_element_type=jnp.float32)
    o = o + p[..., -1:] * k[:, None, :self.kv_lora].astype(jnp.float32)
    w_uv = self.wkv_b.kernel[...][..., self.nope:].astype(jnp.float32)   # [kv_lora, H, v]
    o = jnp.einsum("bhc,chv->bhv", o, w_uv)[:, None]                     # [B, 1, H, v]
    gate = jax.nn.sigmoid(self.w_g(x).astype(jnp.float32))
    return self.w_o((o * gate).astype(self.dtype)), {"latent": k}

  def write(self, cache: dict, entry: dict, pos: jax.Array, index: tuple = ()) -> dict:
    """The cache with `entry` at each row's pos [B]; index: leading (layer) positions."""
    latent = cache["latent"]
    rows = jnp.arange(pos.shape[0])
    latent = latent.at[(*index, rows, pos)].set(entry["latent"].astype(latent.dtype))
    return axes.constrain_each({"latent": latent}, CACHE_AXES, stacked=len(index))

  def clip_qk(self, logit_max: jax.Array, tau: float) -> jax.Array:
    """QK-Clip (K3_SPEC 5), in place: heads with max logit S > tau scale NoPE q and k by
    sqrt(tau / S) and the rope-slot query by tau / S (the shared key is untouched).
    logit_max: [*L, H]. Returns the number of clipped heads."""
    gamma = jnp.where(logit_max > tau, tau / logit_max, 1.0)[..., None, :, None]  # [*L,1,H,1]
    root = jnp.sqrt(gamma)
    wq = self.wq_b.kernel[...]  # [*L, q_lora, H, nope + rope]
    # set_value: see latent_moe.update_bias
    self.wq_b.kernel.set_value(jnp.concatenate(
        [wq[..., :self.nope] * root, wq[..., self.nope:] * gamma], axis=-1).astype(wq.dtype))
    wkv = self.wkv_b.kernel[...]                                          # [*L, kv_lora, H, nope+v]
    self.wkv_b.kernel.set_value(jnp.concatenate(
        [wkv[..., :self.nope] * root, wkv[..., self.nope:]], axis=-1).astype(wkv.dtype))
    return jnp.sum(logit_max > tau)

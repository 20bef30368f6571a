"""MoonViT-V2, the K3 vision tower (K3_SPEC 6), and where its features enter the text.

  x     = patches W_patch + pos(row, col | h, w) [+ sincos(frame) for videos]   [N, width]
  x     = Block^L(x, segment_ids)      pre-norm, bidirectional attention within an item
  x     = RMSNorm(x)                                                            [N, width]
  z     = merge(x)                     m x m window -> concat (row-major)       [K, m*m*width]
  z     = mean over the temporal_pool windows of one video token (images: itself)
  y     = RMSNorm(W_2 gelu(W_1 z))     the projector, as released            [K, d_model]

Blocks use 2-D RoPE (`vision_pos.rope_2d`) and a GELU-tanh MLP, no biases, as released;
`insert_features` writes the K rows over the text's placeholder tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import axes
from k3jax.axes import constrain
from k3jax.media import PackedMedia
from k3jax.model import layers
from k3jax.model.layers import Dense, RMSNorm
from k3jax.model.vision_pos import grid_embedding, rope_2d, sincos_embedding
from pallas_kernels import attention as attention_ops

# The packed patch axis shards like a batch axis.
NE = ("batch", "embed")
NHD = ("batch", "heads", "head_dim")


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                      scale: float, backend: str = "auto") -> jax.Array:
  """Attention within segments: q, k [N, H, Dk], v [N, H, Dv] -> [N, H, Dv]."""
  spec = axes.logical_to_spec(NHD)
  out = attention_ops.attention(q[None], k[None], v[None], segment_ids[None], scale=scale,
                                causal=False, backend=backend, mesh=axes.current_mesh(),
                                seq_axis=spec[0], head_axis=spec[1])
  return out[0]


class VisionBlock(nnx.Module):
  """One pre-norm transformer block. x [N, width], segment_ids [N] -> [N, width]."""

  def __init__(self, v, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
    shape, dense = (v.num_heads, v.head_dim), dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.scale = v.head_dim ** -0.5
    self.backend = v.attention
    self.rope_theta = v.rope_theta if v.rope_2d else None
    self.attn_norm = RMSNorm(v.width, eps=eps, param_dtype=param_dtype, rngs=rngs)
    self.wq = Dense(v.width, shape, ("embed", "heads", "head_dim"), muon="per_head", **dense)
    self.wk = Dense(v.width, shape, ("embed", "heads", "head_dim"), muon="per_head", **dense)
    self.wv = Dense(v.width, shape, ("embed", "heads", "head_dim"), muon="per_head", **dense)
    self.wo = Dense(shape, v.width, ("heads", "head_dim", "embed"), **dense)
    self.mlp_norm = RMSNorm(v.width, eps=eps, param_dtype=param_dtype, rngs=rngs)
    self.w1 = Dense(v.width, v.mlp_dim, ("embed", "mlp"), **dense)
    self.w2 = Dense(v.mlp_dim, v.width, ("mlp", "embed"), **dense)
    self.dtype = dtype

  def __call__(self, x: jax.Array, segment_ids: jax.Array, coords: jax.Array) -> jax.Array:
    """coords [N, 3] int: each patch's (frame, row, col), for the 2-D RoPE."""
    h = self.attn_norm(x)
    q, k, v = (constrain(w(h), NHD) for w in (self.wq, self.wk, self.wv))
    if self.rope_theta is not None:
      q, k = (rope_2d(a, coords[:, 1], coords[:, 2], self.rope_theta) for a in (q, k))
    o = constrain(segment_attention(q, k, v, segment_ids, self.scale, self.backend), NHD)
    x = constrain(x + self.wo(o), NE)
    u = constrain(self.w1(self.mlp_norm(x)), ("batch", "mlp"))
    u = jax.nn.gelu(u.astype(jnp.float32), approximate=True).astype(self.dtype)
    return constrain(x + self.w2(u), NE)


class Projector(nnx.Module):
  """Merged features [K, dim] -> [K, out]: Dense-GELU-Dense or one Dense, RMSNorm."""

  def __init__(self, dim: int, hidden: int, out: int, *, norm: str, act: str, eps: float,
               dtype, param_dtype, rngs: nnx.Rngs):
    dense = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.post = norm == "post"
    self.norm = (RMSNorm(out, "embed", eps=eps, param_dtype=param_dtype, rngs=rngs) if self.post
                 else RMSNorm(dim, None, eps=eps, param_dtype=param_dtype, rngs=rngs))
    self.hidden, self.tanh = hidden, act == "gelu_tanh"
    if hidden:
      self.w1 = Dense(dim, hidden, (None, "mlp"), **dense)
      self.w2 = Dense(hidden, out, ("mlp", "embed"), **dense)
    else:
      self.w = Dense(dim, out, (None, "embed"), **dense)

  def __call__(self, z: jax.Array) -> jax.Array:
    if not self.post:
      z = self.norm(z)
    if self.hidden:
      u = jax.nn.gelu(self.w1(z).astype(jnp.float32), approximate=self.tanh)
      y = self.w2(u.astype(z.dtype))
    else:
      y = self.w(z)
    return self.norm(y) if self.post else y


class VisionTower(nnx.Module):
  """MoonViT-V2 + projector: PackedMedia -> features [N // merge**2, d_model]."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    v = cfg_model.vision
    dtype, pdt = jnp.dtype(cfg_model.dtype), jnp.dtype(cfg_model.param_dtype)
    eps = v.norm_eps
    self.width, self.merge, self.temporal_pool = v.width, v.merge, v.temporal_pool
    merged = v.merge * v.merge * v.width
    self.dtype = dtype
    pixels = v.patch_size * v.patch_size * 3
    self.patch_embed = Dense(pixels, v.width, (None, "embed"), rngs=rngs, dtype=dtype,
                             param_dtype=pdt)
    init = layers.normal(0.02)
    self.pos_table = layers.param(rngs, init, (v.pos_grid, v.pos_grid, v.width),
                                  (None, None, "embed"), pdt)

    @nnx.split_rngs(splits=v.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(r):
      return VisionBlock(v, eps=eps, dtype=dtype, param_dtype=pdt, rngs=r)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(v.width, eps=eps, param_dtype=pdt, rngs=rngs)
    self.projector = Projector(merged, projector_width(v), cfg_model.d_model,
                               norm=v.projector_norm, act=v.projector_act,
                               eps=cfg_model.norm_eps, dtype=dtype, param_dtype=pdt, rngs=rngs)

  def positions(self, media: PackedMedia) -> jax.Array:
    """The position embedding of every patch [N, width] fp32."""
    grid = jnp.asarray(media.grid_thw)[jnp.maximum(media.segment_ids - 1, 0)]   # [N, 3]
    frame, row, col = (media.coords[:, i] for i in range(3))
    pos = grid_embedding(self.pos_table[...], row, col, grid[:, 1], grid[:, 2])
    video = (grid[:, 0] > 1)[:, None]
    return pos.astype(jnp.float32) + jnp.where(video, sincos_embedding(frame, self.width), 0.0)

  def encode(self, media: PackedMedia) -> jax.Array:
    """Patch features after the tower's final norm: [N, width] (compute dtype)."""
    x = self.patch_embed(jnp.asarray(media.patches))
    x = constrain((x.astype(jnp.float32) + self.positions(media)).astype(self.dtype), NE)
    graphdef, state = nnx.split(self.blocks)

    def body(x, block_state):
      return nnx.merge(graphdef, block_state)(x, media.segment_ids, media.coords), None

    x, _ = jax.lax.scan(body, x, state)
    return self.final_norm(x)

  def merge_pool(self, x: jax.Array, pool_ids: jax.Array) -> jax.Array:
    """[N, width] -> [K, merge**2 * width]: windows concatenated, pooled per token."""
    k = x.shape[0] // (self.merge * self.merge)
    z = x.reshape(k, -1).astype(jnp.float32)
    total = jax.ops.segment_sum(z, pool_ids, num_segments=k)
    count = jax.ops.segment_sum(jnp.ones((k,), jnp.float32), pool_ids, num_segments=k)
    return constrain((total / jnp.maximum(count, 1.0)[:, None]).astype(x.dtype), ("batch", None))

  def __call__(self, media: PackedMedia) -> jax.Array:
    """PackedMedia -> features [N // merge**2, d_model] (compute dtype)."""
    z = self.merge_pool(self.encode(media), jnp.asarray(media.pool_ids))
    return constrain(self.projector(z), NE)


def insert_features(embeds: jax.Array, tokens: jax.Array, features: jax.Array,
                    placeholder_id: int) -> jax.Array:
  """embeds [B, T, D] with features[k] over the k-th placeholder (row-major)."""
  is_ph = tokens == placeholder_id                                      # [B, T]
  k = jnp.cumsum(is_ph.reshape(-1)).reshape(is_ph.shape) - 1
  rows = features[jnp.clip(k, 0, features.shape[0] - 1)].astype(embeds.dtype)  # [B, T, D]
  return jnp.where((is_ph & (k < features.shape[0]))[..., None], rows, embeds)


def projector_width(v) -> int:
  """The projector's hidden width from `vision.projector_hidden` (-1: its input's)."""
  return v.merge * v.merge * v.width if v.projector_hidden == -1 else v.projector_hidden


def param_counts(cfg_model) -> dict[str, int]:
  """{"tower", "projector"} parameter counts of `cfg_model.vision`, analytically."""
  v = cfg_model.vision
  inner = v.num_heads * v.head_dim
  block = 4 * v.width * inner + 2 * v.width * v.mlp_dim + 2 * v.width
  pos = v.pos_grid * v.pos_grid * v.width
  tower = v.num_layers * block + v.patch_size ** 2 * 3 * v.width + pos + v.width
  merged, h, d = v.merge * v.merge * v.width, projector_width(v), cfg_model.d_model
  norm = d if v.projector_norm == "post" else merged
  projector = norm + (merged * h + h * d if h else merged * d)
  return {"tower": tower, "projector": projector}

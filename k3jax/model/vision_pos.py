"""MoonViT-V2 position embeddings (K3_SPEC 6), read inside jit; the packed inputs they
index are `k3jax.media`'s.

Spatial: a learned [G, G, width] table interpolated bilinearly (as torch's
align_corners=False) to each item's (h, w). Temporal: fixed sin-cos of the frame, videos only."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def source_index(dst: jax.Array, n_out: jax.Array, n_in: int):
  """(i0, i1, frac) of bilinear sources of `dst` resized from n_in to n_out."""
  scale = n_in / jnp.maximum(n_out, 1).astype(jnp.float32)
  src = jnp.clip((dst.astype(jnp.float32) + 0.5) * scale - 0.5, 0.0, n_in - 1)
  i0 = jnp.floor(src).astype(jnp.int32)
  i1 = jnp.minimum(i0 + 1, n_in - 1)
  return i0, i1, src - i0


def grid_embedding(table: jax.Array, rows: jax.Array, cols: jax.Array, heights: jax.Array,
                   widths: jax.Array) -> jax.Array:
  """The table [G_h, G_w, D] resized to each patch's grid: [N] ints -> [N, D]."""
  gh, gw = table.shape[:2]
  y0, y1, fy = source_index(rows, heights, gh)
  x0, x1, fx = source_index(cols, widths, gw)
  t = table.astype(jnp.float32)
  fy, fx = fy[:, None], fx[:, None]
  out = ((1 - fy) * ((1 - fx) * t[y0, x0] + fx * t[y0, x1])
         + fy * ((1 - fx) * t[y1, x0] + fx * t[y1, x1]))
  return out.astype(table.dtype)


def sincos_embedding(pos: jax.Array, dim: int, base: float = 10_000.0) -> jax.Array:
  """Fixed 1-D embedding [N, dim] fp32: sines then cosines of positions [N]."""
  half = dim // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
  angle = pos.astype(jnp.float32)[:, None] * freq[None, :]
  out = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
  return jnp.pad(out, ((0, 0), (0, dim - 2 * half)))


def rope_2d(x: jax.Array, rows: jax.Array, cols: jax.Array, theta: float = 10_000.0) -> jax.Array:
  """2-D RoPE as the released tower: x [N, H, D] (D % 4 == 0), rows, cols [N] -> [N, H, D].
  Channel pairs alternate column and row angles, f_j = theta ** (-4j / D); fp32 maths."""
  n, h, d = x.shape
  freq = theta ** (-4.0 * jnp.arange(d // 4, dtype=jnp.float32) / d)             # [D/4]
  angle = jnp.stack([cols.astype(jnp.float32)[:, None] * freq,
                     rows.astype(jnp.float32)[:, None] * freq], axis=-1).reshape(n, 1, d // 2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  pairs = x.astype(jnp.float32).reshape(n, h, d // 2, 2)
  re, im = pairs[..., 0], pairs[..., 1]
  out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
  return out.reshape(n, h, d).astype(x.dtype)

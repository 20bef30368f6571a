"""MoonViT-V2 position embeddings (K3_SPEC 6), read inside jit; the packed inputs they
index are `k3jax.media`'s.

Position embeddings ("divided fixed"): the spatial part is learned at a base grid of
G x G patches and interpolated bilinearly (half-pixel centres, edge-clamped, as
`torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`) to each item's
(h, w); at h = w = G it is the table itself (one [G, G, width] table). The temporal part of a
video is fixed, not learned: a 1-D sin-cos embedding of the frame index, added only to
items with t > 1 (an image is unchanged by it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def source_index(dst: jax.Array, n_out: jax.Array, n_in: int):
  """Bilinear sources of output positions `dst` on an axis resized from n_in to n_out.

  Half-pixel centres: src = (dst + 0.5) * n_in / n_out - 0.5, clamped to [0, n_in - 1].
  dst, n_out: int arrays of one shape. Returns (i0, i1, frac): the output is
  (1 - frac) * table[i0] + frac * table[i1]. At n_out == n_in, frac == 0 and i0 == dst.
  """
  scale = n_in / jnp.maximum(n_out, 1).astype(jnp.float32)
  src = jnp.clip((dst.astype(jnp.float32) + 0.5) * scale - 0.5, 0.0, n_in - 1)
  i0 = jnp.floor(src).astype(jnp.int32)
  i1 = jnp.minimum(i0 + 1, n_in - 1)
  return i0, i1, src - i0


def grid_embedding(table: jax.Array, rows: jax.Array, cols: jax.Array, heights: jax.Array,
                   widths: jax.Array) -> jax.Array:
  """The [G_h, G_w, D] table resized bilinearly to each patch's (height, width) grid, read at
  its (row, col). rows, cols, heights, widths: [N] int -> [N, D] (table dtype, fp32 maths)."""
  gh, gw = table.shape[:2]
  y0, y1, fy = source_index(rows, heights, gh)
  x0, x1, fx = source_index(cols, widths, gw)
  t = table.astype(jnp.float32)
  fy, fx = fy[:, None], fx[:, None]
  out = ((1 - fy) * ((1 - fx) * t[y0, x0] + fx * t[y0, x1])
         + fy * ((1 - fx) * t[y1, x0] + fx * t[y1, x1]))
  return out.astype(table.dtype)


def sincos_embedding(pos: jax.Array, dim: int, base: float = 10_000.0) -> jax.Array:
  """Fixed 1-D embedding [N, dim] fp32 of positions [N]: sin of dim // 2 frequencies
  base**(-2i/dim) then their cos (zero-padded for an odd dim)."""
  half = dim // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / max(half, 1))
  angle = pos.astype(jnp.float32)[:, None] * freq[None, :]
  out = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
  return jnp.pad(out, ((0, 0), (0, dim - 2 * half)))


def rope_2d(x: jax.Array, rows: jax.Array, cols: jax.Array, theta: float = 10_000.0) -> jax.Array:
  """2-D rotary positions, as the released K3's tower applies them to q and k: x [N, H, D]
  (D a multiple of 4), rows, cols [N] int (a patch's place in its frame) -> [N, H, D] in
  x's dtype. Channels (2i, 2i + 1) are one complex number, turned by the angle
  col * f_{i/2} for even i and row * f_{(i-1)/2} for odd i, f_j = theta ** (-4j / D):
  column and row take the D / 4 frequencies in turn. fp32 maths."""
  n, h, d = x.shape
  freq = theta ** (-4.0 * jnp.arange(d // 4, dtype=jnp.float32) / d)             # [D/4]
  angle = jnp.stack([cols.astype(jnp.float32)[:, None] * freq,
                     rows.astype(jnp.float32)[:, None] * freq], axis=-1).reshape(n, 1, d // 2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  pairs = x.astype(jnp.float32).reshape(n, h, d // 2, 2)
  re, im = pairs[..., 0], pairs[..., 1]
  out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
  return out.reshape(n, h, d).astype(x.dtype)

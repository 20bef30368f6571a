"""The packed-media contract (K3_SPEC 6): what the pipeline packs and the vision tower reads.

Host side (numpy): `patchify` / `patchify_video` -> (patches [n, P*P*3] in merge order,
grid); `pack` -> a fixed-shape `PackedMedia` (N = max_patches, M = max_media, K = N //
merge**2). uint8 pixels map to [-1, 1]; images are padded, not resized, to multiples of
patch * merge. Merge order: per output token its frames, each an m x m window row-major, so
merging is a reshape. N must divide over the data-parallel devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np


class PackedMedia(NamedTuple):
  """Several images / videos packed into fixed-shape buffers (module docstring)."""
  patches: jax.Array | np.ndarray       # [N, P*P*3] float32
  segment_ids: jax.Array | np.ndarray   # [N] int32, 0 = padding
  coords: jax.Array | np.ndarray        # [N, 3] int32 (frame, row, col)
  grid_thw: jax.Array | np.ndarray      # [M, 3] int32 (t, h, w) of item k at row k-1
  pool_ids: jax.Array | np.ndarray      # [K] int32 output token per window; K: padding


def _pixels(x: np.ndarray) -> np.ndarray:
  if x.dtype == np.uint8:
    return x.astype(np.float32) / 127.5 - 1.0
  if not np.issubdtype(x.dtype, np.floating):
    raise ValueError(f"patchify: pixels must be uint8 or float, got {x.dtype}")
  return x.astype(np.float32)


def merge_order(t: int, h: int, w: int, merge: int, temporal_pool: int) -> np.ndarray:
  """(frame, row, col) [t*h*w, 3] int32 of each patch of a (t, h, w) grid in merge order."""
  m, p = merge, (temporal_pool if t > 1 else 1)
  g, i, j, f, a, b = np.meshgrid(np.arange(t // p), np.arange(h // m), np.arange(w // m),
                                 np.arange(p), np.arange(m), np.arange(m), indexing="ij")
  coords = np.stack([g * p + f, i * m + a, j * m + b], axis=-1)
  return coords.reshape(-1, 3).astype(np.int32)


def num_tokens(grid: Sequence[int], merge: int, temporal_pool: int) -> int:
  """Output tokens of an item of grid (h, w) or (t, h, w)."""
  t, h, w = (1, *grid) if len(grid) == 2 else grid
  return (t // (temporal_pool if t > 1 else 1)) * (h // merge) * (w // merge)


def _patchify(frames: np.ndarray, patch_size: int, merge: int, temporal_pool: int,
              max_patches: int | None, what: str) -> tuple[np.ndarray, tuple[int, int, int]]:
  """frames [T, H, W, 3] (shape checked by the caller) -> patches in merge order, (T, h, w)."""
  t, height, width, _ = frames.shape
  unit = patch_size * merge
  if height < unit or width < unit:
    raise ValueError(f"{what}: image {height}x{width} px is too small: the {merge}x{merge} "
                     f"merge of {patch_size}-px patches needs at least {unit}x{unit} px")
  ph, pw = -height % unit, -width % unit
  x = np.pad(_pixels(frames), ((0, 0), (0, ph), (0, pw), (0, 0)))
  h, w = x.shape[1] // patch_size, x.shape[2] // patch_size
  if max_patches is not None and t * h * w > max_patches:
    raise ValueError(f"{what}: {t * h * w} patches ({t} x {h} x {w} of {patch_size} px) is too "
                     f"large: more than model.vision.max_patches={max_patches}")
  grid = x.reshape(t, h, patch_size, w, patch_size, 3).transpose(0, 1, 3, 2, 4, 5)
  grid = grid.reshape(t, h, w, patch_size * patch_size * 3)       # [t, h, w, P*P*3]
  c = merge_order(t, h, w, merge, temporal_pool)
  return grid[c[:, 0], c[:, 1], c[:, 2]], (t, h, w)


def patchify(image: np.ndarray, *, patch_size: int = 14, merge: int = 2,
             max_patches: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
  """image [H, W, 3] -> (patches [h*w, P*P*3] float32 in merge order, (h, w))."""
  image = np.asarray(image)
  if image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(f"patchify: expected [H, W, 3] RGB pixels, got shape {image.shape}")
  patches, (_, h, w) = _patchify(image[None], patch_size, merge, 1, max_patches, "patchify")
  return patches, (h, w)


def patchify_video(frames: np.ndarray, *, patch_size: int = 14, merge: int = 2,
                   temporal_pool: int = 2, max_patches: int | None = None
                   ) -> tuple[np.ndarray, tuple[int, int, int]]:
  """frames [T, H, W, 3] -> (patches [T*h*w, P*P*3], (T, h, w)); T % temporal_pool == 0."""
  frames = np.asarray(frames)
  if frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"patchify_video: expected [T, H, W, 3] RGB frames, got shape {frames.shape}")
  if frames.shape[0] < 2 or frames.shape[0] % temporal_pool:
    raise ValueError(f"patchify_video: {frames.shape[0]} frames; a video needs a multiple of "
                     f"temporal_pool={temporal_pool} frames (>= 2); use patchify for one frame")
  return _patchify(frames, patch_size, merge, temporal_pool, max_patches, "patchify_video")


def pack(items: Sequence[tuple[np.ndarray, Sequence[int]]], *, max_patches: int,
         max_media: int, merge: int = 2, temporal_pool: int = 2
         ) -> tuple[PackedMedia, list[int]]:
  """Pack patchified items [(patches, (h, w) or (t, h, w)), ...] into one PackedMedia.
  Returns it and each item's output-token count (its placeholders in the text).
  ValueError past max_patches or max_media."""
  if max_patches % (merge * merge * temporal_pool):
    raise ValueError(f"pack: max_patches={max_patches} must be a multiple of "
                     f"merge**2 * temporal_pool = {merge * merge * temporal_pool}")
  if len(items) > max_media:
    raise ValueError(f"pack: {len(items)} items, more than max_media={max_media}")
  total = sum(len(p) for p, _ in items)
  if total > max_patches:
    raise ValueError(f"pack: {total} patches, more than max_patches={max_patches}")
  dim = items[0][0].shape[-1] if items else 0
  window = merge * merge
  k_max = max_patches // window
  patches = np.zeros((max_patches, dim), np.float32)
  segment_ids = np.zeros((max_patches,), np.int32)
  coords = np.zeros((max_patches, 3), np.int32)
  grid_thw = np.zeros((max_media, 3), np.int32)
  pool_ids = np.full((k_max,), k_max, np.int32)
  start = token = 0
  tokens = []
  for k, (p, grid) in enumerate(items):
    t, h, w = (1, *grid) if len(grid) == 2 else tuple(grid)
    if len(p) != t * h * w or h % merge or w % merge:
      raise ValueError(f"pack: item {k} has {len(p)} patches for grid {(t, h, w)} "
                       f"(h and w must be multiples of merge={merge}); use patchify")
    end = start + len(p)
    patches[start:end] = p
    segment_ids[start:end] = k + 1
    coords[start:end] = merge_order(t, h, w, merge, temporal_pool)
    grid_thw[k] = (t, h, w)
    n = num_tokens((t, h, w), merge, temporal_pool)
    pool = temporal_pool if t > 1 else 1
    pool_ids[start // window:end // window] = token + np.arange(n * pool) // pool
    tokens.append(n)
    start, token = end, token + n
  return PackedMedia(patches, segment_ids, coords, grid_thw, pool_ids), tokens

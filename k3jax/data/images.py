"""Image-text examples for the MoonViT-V2 tower (K3_SPEC 6): generated shapes, or local files.

An example: [bos] + [placeholder] * n + text ids + [eos] as inputs/targets int32 [L], patches
float32 [t*h*w, P*P*3] in merge order, grid int32 [1, 3]. `data.images.source`: "generated"
(seeded captioned shapes) or "files" (JSONL manifests {"image" | "video": path, "text"})."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import ml_collections
import numpy as np

from k3jax import paths
from k3jax.media import num_tokens, patchify, patchify_video

IMAGE_SOURCES = ("none", "generated", "files")
SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240),
           "yellow": (235, 220, 40), "white": (245, 245, 245), "magenta": (220, 50, 220)}
CELLS = ("top left", "top", "top right", "left", "centre", "right",
         "bottom left", "bottom", "bottom right")
COUNT_WORDS = ("a", "two", "three", "four")
BACKGROUND = 20
_SPLIT_IDS = {"train": 0, "validation": 1}


def images_config() -> ml_collections.ConfigDict:
  """Defaults of `data.images` (image-text examples mixed into the text; off by default)."""
  c = ml_collections.ConfigDict()
  c.source = "none"          # one of IMAGE_SOURCES
  c.weight = 1.0             # share of training examples, against the text sources' weights
  c.paths = ()               # source="files": glob(s) of JSONL manifests
  # source="generated": examples per split, canvas sides
  c.train_examples = 100_000
  c.validation_examples = 256
  c.min_size, c.max_size = 56, 112
  return c


def check_images_config(c: ml_collections.ConfigDict) -> None:
  """ValueError naming the first bad field of `data.images` (reads no file)."""
  if c.source not in IMAGE_SOURCES:
    raise ValueError(f"config.data.images.source must be one of {IMAGE_SOURCES}, "
                     f"got {c.source!r}")
  if isinstance(c.weight, bool) or not isinstance(c.weight, (int, float)) or not c.weight > 0:
    raise ValueError(f"config.data.images.weight must be a positive number, got {c.weight!r}")
  for field in ("train_examples", "validation_examples"):
    if not isinstance(c[field], int) or c[field] < 1:
      raise ValueError(f"config.data.images.{field} must be an integer >= 1, got {c[field]!r}")
  if not 28 <= c.min_size <= c.max_size:
    raise ValueError(f"config.data.images: need 28 <= min_size <= max_size, got "
                     f"{c.min_size}, {c.max_size}")
  paths = (c.paths,) if isinstance(c.paths, str) else tuple(c.paths)
  if c.source == "files" and not any(paths):
    raise ValueError("config.data.images.paths: source='files' needs JSONL manifest glob(s)")
  if c.source != "files" and any(paths):
    raise ValueError(f"config.data.images.paths is set but config.data.images.source is "
                     f"{c.source!r}; set it to 'files'")


class MediaSpec(NamedTuple):
  """What the pipeline needs of `model.vision`: patch geometry, buffer sizes, placeholder."""
  patch_size: int
  merge: int
  temporal_pool: int
  max_patches: int
  max_media: int
  placeholder_id: int

  @classmethod
  def from_config(cls, vision: ml_collections.ConfigDict) -> MediaSpec:
    return cls(vision.patch_size, vision.merge, vision.temporal_pool, vision.max_patches,
               vision.max_media, vision.placeholder_id)

  @property
  def patch_dim(self) -> int:
    return self.patch_size * self.patch_size * 3



def _mask(shape: str, size: int) -> np.ndarray:
  y, x = np.mgrid[:size, :size] + 0.5
  c, r = size / 2, size / 2
  if shape == "square":
    return np.ones((size, size), bool)
  if shape == "circle":
    return (y - c) ** 2 + (x - c) ** 2 <= r * r
  if shape == "triangle":
    return np.abs(x - c) <= (y / size) * r
  if shape == "cross":
    bar = max(size // 6, 1)
    return (np.abs(x - c) <= bar) | (np.abs(y - c) <= bar)
  raise ValueError(f"unknown shape {shape!r} (known: {SHAPES})")


def caption(count: int, colour: str, shape: str, cell: str | None) -> str:
  """The text of a picture: "a red circle at the top left", "three blue crosses"."""
  if count > 1:
    plural = shape + ("es" if shape.endswith("s") else "s")
    return f"{COUNT_WORDS[count - 1]} {colour} {plural}"
  where = "in the centre" if cell == "centre" else f"at the {cell}"
  return f"a {colour} {shape} {where}"


def generate(seed: int, split: str, index: int, *, min_size: int = 56, max_size: int = 112
             ) -> tuple[np.ndarray, str, dict]:
  """Picture `index` of `split`: (uint8 [H, W, 3], caption, facts), deterministic."""
  rng = np.random.default_rng([seed, _SPLIT_IDS[split], index])
  height, width = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
  count = int(rng.integers(1, 5))
  colour = str(rng.choice(list(COLOURS)))
  shape = str(rng.choice(SHAPES))
  cells = sorted(int(c) for c in rng.choice(9, count, replace=False))
  image = np.full((height, width, 3), BACKGROUND, np.uint8)
  ch, cw = height // 3, width // 3
  size = int(rng.integers(max(int(0.6 * min(ch, cw)), 6), int(0.9 * min(ch, cw)) + 1))
  stencil = _mask(shape, size)
  for cell in cells:
    r, c = divmod(cell, 3)
    top = r * ch + int(rng.integers(0, ch - size + 1))
    left = c * cw + int(rng.integers(0, cw - size + 1))
    image[top:top + size, left:left + size][stencil] = COLOURS[colour]
  text = caption(count, colour, shape, CELLS[cells[0]] if count == 1 else None)
  return image, text, {"count": count, "colour": colour, "shape": shape, "cells": cells,
                       "size": size}



def load_pixels(path: str) -> np.ndarray:
  """Pixels of a .npy or Pillow-readable file; ValueError naming it if undecodable."""
  if path.endswith(".npy"):
    try:
      with paths.path(path).open("rb") as f:
        return np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
      raise ValueError(f"{path}: not a readable .npy array ({e})") from None
  try:
    from PIL import Image  # noqa: PLC0415  (optional: .npy needs nothing)
  except ImportError:
    raise ValueError(f"{path}: reading {os.path.splitext(path)[1] or 'this'} images needs "
                     f"Pillow (pip install pillow); or store the pixels as .npy") from None
  try:
    with paths.path(path).open("rb") as f, Image.open(f) as im:
      return np.asarray(im.convert("RGB"))
  except Exception as e:
    raise ValueError(f"{path}: not a readable image ({type(e).__name__}: {e})") from None


def read_manifests(patterns, split: str, heldout_every: int) -> list[dict]:
  """Entries {"path", "video", "text"} of the manifests matching `patterns` in `split`."""
  patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
  entries = []
  for pattern in patterns:
    files = paths.glob(pattern)
    if not files:
      raise FileNotFoundError(f"config.data.images.paths: no file matches {pattern!r}")
    for manifest in files:
      with paths.path(manifest).open("r") as f:
        for lineno, line in enumerate(f, 1):
          if not line.strip():
            continue
          where = f"{manifest}:{lineno}"
          try:
            obj = json.loads(line)
          except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
          keys = [k for k in ("image", "video") if k in obj] if isinstance(obj, dict) else []
          if len(keys) != 1 or not isinstance(obj.get("text"), str):
            raise ValueError(f"{where}: need {{'image' or 'video': path, 'text': str}}, "
                             f"got {line.strip()[:80]}")
          path = obj[keys[0]]
          if not (paths.is_url(path) or os.path.isabs(path)):
            path = os.fspath(paths.path(manifest).parent / path)
          entries.append({"path": path, "video": keys[0] == "video", "text": obj["text"]})
  if heldout_every:
    keep = [(i % heldout_every == 0) == (split == "validation") for i in range(len(entries))]
    entries = [e for e, k in zip(entries, keep) if k]
  if not entries:
    raise ValueError(f"config.data.images.paths: no {split} entries (heldout_every="
                     f"{heldout_every})")
  return entries



class ImageTextExamples:
  """`examples[i]` -> {"inputs", "targets", "patches", "grid"}, for grain's MapDataset."""

  def __init__(self, cfg_images, spec: MediaSpec, tokenizer, *, seq_len: int, seed: int,
               split: str, heldout_every: int = 0):
    check_images_config(cfg_images)
    self._cfg, self._spec, self._tokenizer = cfg_images, spec, tokenizer
    self._seq_len, self._seed, self._split = seq_len, seed, split
    if cfg_images.source == "generated":
      self._entries = None
      self._len = (cfg_images.train_examples if split == "train"
                   else cfg_images.validation_examples)
    elif cfg_images.source == "files":
      self._entries = read_manifests(cfg_images.paths, split, heldout_every)
      self._len = len(self._entries)
    else:
      raise ValueError("config.data.images.source is 'none': no image examples")

  def __len__(self) -> int:
    return self._len

  def pixels_and_text(self, i: int) -> tuple[np.ndarray, bool, str, str]:
    """(pixels, is_video, text, where) of example i."""
    if self._entries is None:
      c = self._cfg
      image, text, _ = generate(self._seed, self._split, i, min_size=c.min_size,
                                max_size=c.max_size)
      return image, False, text, f"generated {self._split} image {i}"
    e = self._entries[i]
    return load_pixels(e["path"]), e["video"], e["text"], e["path"]

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    pixels, video, text, where = self.pixels_and_text(int(i))
    s = self._spec
    try:
      if video:
        patches, grid = patchify_video(pixels, patch_size=s.patch_size, merge=s.merge,
                                       temporal_pool=s.temporal_pool, max_patches=s.max_patches)
      else:
        patches, (h, w) = patchify(pixels, patch_size=s.patch_size, merge=s.merge,
                                   max_patches=s.max_patches)
        grid = (1, h, w)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    return example(patches, grid, self._tokenizer.encode(text), s,
                   bos=self._tokenizer.bos_id, eos=self._tokenizer.eos_id,
                   seq_len=self._seq_len, where=where)


def example(patches: np.ndarray, grid, text_ids, spec: MediaSpec, *, bos: int, eos: int,
            seq_len: int, where: str = "example") -> dict[str, np.ndarray]:
  """One packed-pipeline element: the placeholder run, then the text (module docstring)."""
  n = num_tokens(tuple(grid), spec.merge, spec.temporal_pool)
  tokens = np.concatenate([[bos], np.full(n, spec.placeholder_id), np.asarray(text_ids),
                           [eos]]).astype(np.int32)
  if len(tokens) - 1 > seq_len:
    raise ValueError(f"{where}: {n} image tokens + {len(text_ids)} text tokens + bos/eos do "
                     f"not fit train.seq_len={seq_len}; image-text examples are not cut")
  return {"inputs": tokens[:-1], "targets": tokens[1:],
          "patches": np.asarray(patches, np.float32),
          "grid": np.asarray([grid], np.int32).reshape(1, 3)}


def no_media(piece: dict[str, np.ndarray], patch_dim: int) -> dict[str, np.ndarray]:
  """A text piece with empty media features, to pack with image-text elements."""
  return {**piece, "patches": np.zeros((0, patch_dim), np.float32),
          "grid": np.zeros((0, 3), np.int32)}

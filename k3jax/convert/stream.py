"""Arrays assembled on their devices from reads of only the parts each process holds.

A `Source` maps a box ((start, stop) per axis) to a NumPy array; `assemble` builds a
sharded jax.Array with each process reading only its devices' boxes. Sources compose:
`stacked`, `transposed`, `converted`; `from_file` and `from_mxfp4` read safetensors rows."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from k3jax.convert import safetensors
from k3jax.model import mxfp4

Box = tuple[tuple[int, int], ...]
Source = Callable[[Box], np.ndarray]


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
  return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))


class Progress:
  """Bytes assembled so far, reported through `log` at most every `every` seconds."""

  def __init__(self, total_bytes: int, log: Callable[[str], None] = print, every: float = 10):
    self.total, self.done, self.log, self.every = total_bytes, 0, log, every
    self.start = self.last = time.monotonic()
    self._lock = threading.Lock()

  def add(self, nbytes: int) -> None:
    with self._lock:
      self.done += nbytes
      now = time.monotonic()
      if now - self.last >= self.every or self.done >= self.total:
        self.last = now
        rate = self.done / max(now - self.start, 1e-9) / 2**30
        self.log(f"{self.done / 2**30:.2f} of {self.total / 2**30:.2f} GiB "
                 f"({100 * self.done / max(self.total, 1):.0f}%), {rate:.2f} GiB/s")


def assemble(abstract: jax.ShapeDtypeStruct, source: Source,
             progress: Progress | None = None) -> jax.Array:
  """The array of `abstract` from `source`; ValueError naming a box of the wrong shape."""
  shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
  cache: dict[Box, np.ndarray] = {}

  def shard(index):
    box = _box(index, shape)
    if box not in cache:
      x = np.asarray(source(box))
      want = tuple(b - a for a, b in box)
      if x.shape != want:
        raise ValueError(f"source for an array of shape {shape} returned {x.shape} for the "
                         f"box {box} (expected {want})")
      cache[box] = x.astype(dtype, copy=False)
      if progress is not None:
        progress.add(cache[box].nbytes)
    return cache[box]

  return jax.make_array_from_callback(shape, abstract.sharding, shard)


def stacked(parts: Sequence[Source]) -> Source:
  """A leading axis over `parts` (one source per layer or expert, each without it)."""
  def read(box: Box) -> np.ndarray:
    (a, b), rest = box[0], box[1:]
    return np.stack([parts[i](rest) for i in range(a, b)])
  return read


def transposed(source: Source) -> Source:
  """The last two axes swapped: a torch weight [out, in] read as [in, out]."""
  def read(box: Box) -> np.ndarray:
    return np.swapaxes(source((*box[:-2], box[-1], box[-2])), -1, -2)
  return read


def converted(source: Source, fn: Callable[[np.ndarray], np.ndarray]) -> Source:
  """fn applied to what `source` reads (elementwise, so any box stays that box)."""
  return lambda box: fn(source(box))


def _rest(box: Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box[1:])


def from_file(info: safetensors.TensorInfo) -> Source:
  """One safetensors tensor; a box reads the bytes of its leading-axis rows only."""
  def read(box: Box) -> np.ndarray:
    if not box:
      return safetensors.read(info)
    return safetensors.read(info, slice(*box[0]))[(slice(None), *_rest(box))]
  return read


def from_mxfp4(packed: safetensors.TensorInfo, scales: safetensors.TensorInfo) -> Source:
  """An MXFP4 weight [out, in] dequantized to float32 from its packed codes and scales."""
  if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * 32:
    raise safetensors.FormatError(
        f"{packed.file}: {packed.name!r} {list(packed.shape)} and {scales.name!r} "
        f"{list(scales.shape)} are not the codes and scales of one MXFP4 weight")

  def read(box: Box) -> np.ndarray:
    rows = slice(*box[0])
    x = mxfp4.dequantize(safetensors.read(packed, rows), safetensors.read(scales, rows))
    return x[(slice(None), *_rest(box))]
  return read

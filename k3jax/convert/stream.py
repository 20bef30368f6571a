"""Arrays assembled on their devices from reads of only the parts each process holds.

A `Source` maps a box ((start, stop) per axis) to a `Part`: the box's bytes as the file
stores them (bf16, MXFP4 codes and scales) and the function that makes the array from them
on a device. `assemble` builds a sharded jax.Array: each process reads only its devices'
boxes, ships the stored bytes and runs the function there (one compiled call for parts that
`stacked` batches), so the host moves file bytes and the device does the decoding,
transposes and the cast. `from_file` and `from_mxfp4` read safetensors rows."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert import safetensors
from k3jax.model import mxfp4

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Part:
  """A box's array to be: `fn(*leaves)` on a device. Parts of one `key` (not None) compute
  the same function of leaves of the same shapes, so `stacked` batches them; a None key
  runs op by op (it may check values, e.g. zero padding)."""
  leaves: tuple[np.ndarray, ...]
  fn: Callable[..., jax.Array]
  key: Hashable | None

  def map(self, fn: Callable[[jax.Array], jax.Array], key: Hashable | None) -> Part:
    """fn after this part; `key` names fn (None: a function of values, not only shapes)."""
    inner = self.fn
    both = None if key is None or self.key is None else (key, self.key)
    return Part(self.leaves, lambda *leaves: fn(inner(*leaves)), both)


Source = Callable[[Box], "Part | np.ndarray"]


def leaf(x: np.ndarray) -> Part:
  return Part((np.asarray(x),), lambda x: x, "leaf")


def as_part(x: Part | np.ndarray) -> Part:
  return x if isinstance(x, Part) else leaf(x)


_compiled: dict[Hashable, Callable] = {}
_compiled_lock = threading.Lock()


def materialize(part: Part | np.ndarray, device=None, dtype=None) -> jax.Array:
  """The part's array on `device` (default: JAX's), cast to `dtype` if given."""
  part = as_part(part)
  leaves = [jax.device_put(x, device) for x in part.leaves]
  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
  if part.key is None:                                   # op by op
    return cast(part.fn(*leaves))
  key = (part.key, None if dtype is None else np.dtype(dtype).name)
  with _compiled_lock:
    if key not in _compiled:
      fn = part.fn
      _compiled[key] = jax.jit(lambda *leaves: cast(fn(*leaves)))
  return _compiled[key](*leaves)


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
  """The array of `abstract` from `source`, each distinct box read once per process;
  ValueError naming a box of the wrong shape."""
  shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
  done: dict[Box, jax.Array] = {}
  shards = []
  for device, index in abstract.sharding.addressable_devices_indices_map(shape).items():
    box = _box(index, shape)
    if box in done:                     # a replica: copied from the device that made it
      shards.append(jax.device_put(done[box], device))
      continue
    x = materialize(source(box), device, dtype)
    want = tuple(b - a for a, b in box)
    if tuple(x.shape) != want:
      raise ValueError(f"source for an array of shape {shape} returned {tuple(x.shape)} for "
                       f"the box {box} (expected {want})")
    done[box] = x
    shards.append(x)
    if progress is not None:
      progress.add(x.nbytes)
  return jax.make_array_from_single_device_arrays(shape, abstract.sharding, shards)


def stacked(parts: Sequence[Source]) -> Source:
  """A leading axis over `parts` (one source per layer or expert, each without it). Parts
  of one key and leaf shapes are stacked as stored bytes on the host and computed batched."""
  def read(box: Box) -> Part:
    (a, b), rest = box[0], box[1:]
    got = [as_part(parts[i](rest)) for i in range(a, b)]
    first = got[0]
    same = first.key is not None and all(
        p.key == first.key and [x.shape for x in p.leaves] == [x.shape for x in first.leaves]
        and [x.dtype for x in p.leaves] == [x.dtype for x in first.leaves] for p in got)
    if same:
      leaves = tuple(np.stack(column) for column in zip(*(p.leaves for p in got)))
      return Part(leaves, jax.vmap(first.fn), ("stacked", first.key))
    sizes = [len(p.leaves) for p in got]

    def stack(*leaves):
      ends = np.cumsum(sizes)
      return jnp.stack([p.fn(*leaves[end - n:end]) for p, n, end in zip(got, sizes, ends)])
    return Part(tuple(x for p in got for x in p.leaves), stack, None)
  return read


def transposed(source: Source) -> Source:
  """The last two axes swapped: a torch weight [out, in] read as [in, out]."""
  def read(box: Box) -> Part:
    inner = as_part(source((*box[:-2], box[-1], box[-2])))
    return inner.map(lambda x: jnp.swapaxes(x, -1, -2), "transposed")
  return read


def _rest(box: Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box[1:])


def from_file(info: safetensors.TensorInfo) -> Source:
  """One safetensors tensor; a box reads the bytes of its leading-axis rows only."""
  def read(box: Box) -> Part:
    if not box:
      return leaf(safetensors.read(info))
    return leaf(safetensors.read(info, slice(*box[0]))[(slice(None), *_rest(box))])
  return read


def from_mxfp4(packed: safetensors.TensorInfo, scales: safetensors.TensorInfo) -> Source:
  """An MXFP4 weight [out, in] as float32: its rows' codes and scales, decoded on the device."""
  if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * 32:
    raise safetensors.FormatError(
        f"{packed.file}: {packed.name!r} {list(packed.shape)} and {scales.name!r} "
        f"{list(scales.shape)} are not the codes and scales of one MXFP4 weight")

  def read(box: Box) -> Part:
    rows, cols = slice(*box[0]), _rest(box)
    factors = safetensors.read(scales, rows)
    mxfp4.check_scales(factors)
    return Part((safetensors.read(packed, rows), factors),
                lambda codes, factors: mxfp4.dequantize_jax(codes, factors)[(slice(None), *cols)],
                ("mxfp4", box[1:]))
  return read

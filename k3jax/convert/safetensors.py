"""The safetensors format, read by byte ranges and written tensor by tensor.

A file: 8-byte LE header length, JSON header ({name: {"dtype", "shape", "data_offsets"}}),
then the data; several files have `model.safetensors.index.json`. Own code, since reading a
slice of rows must touch only those rows' bytes."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
          "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
          "I32": np.dtype(np.int32), "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
_HEADER_MAX = 100 * 2**20


class FormatError(ValueError):
  """An unreadable safetensors file or index; the message names it."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor's file, dtype, shape and absolute byte range."""
  file: str
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.begin


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """(name -> TensorInfo, metadata) of one file; FormatError if malformed or truncated."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > min(_HEADER_MAX, size - 8):
      raise FormatError(f"{path}: header of {n} bytes in a file of {size}")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise FormatError(f"{path}: the header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise FormatError(f"{path}: the header is not a JSON object")
  metadata = header.pop("__metadata__", None) or {}
  start = 8 + n
  tensors, spans = {}, []
  for name, entry in header.items():
    try:
      dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise FormatError(f"{path}: tensor {name!r} has no dtype, shape and data_offsets") from None
    if dtype_name not in DTYPES:
      raise FormatError(f"{path}: tensor {name!r} has dtype {dtype_name!r}, not one of "
                        f"{sorted(DTYPES)}")
    info = TensorInfo(path, name, DTYPES[dtype_name], tuple(shape), start + begin, start + end)
    want = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    if info.nbytes != want:
      raise FormatError(f"{path}: tensor {name!r} of {dtype_name} {list(shape)} holds "
                        f"{info.nbytes} bytes, not {want}")
    if info.end > size:
      raise FormatError(f"{path}: tensor {name!r} ends at byte {info.end} of a {size}-byte "
                        f"file (truncated)")
    tensors[name] = info
    spans.append((info.begin, info.end, name))
  spans.sort()
  for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
    if begin < end:
      raise FormatError(f"{path}: tensors {a!r} and {b!r} overlap")
  return tensors, metadata


def read(info: TensorInfo, rows: slice | None = None) -> np.ndarray:
  """The tensor, or the rows [start, stop) of its leading axis, reading only those bytes."""
  shape = info.shape
  start, stop = (0, shape[0] if shape else 1) if rows is None else (rows.start, rows.stop)
  row_bytes = (int(np.prod(shape[1:], dtype=np.int64)) if shape else 1) * info.dtype.itemsize
  count = (stop - start) * row_bytes
  with open(info.file, "rb") as f:
    data = os.pread(f.fileno(), count, info.begin + start * row_bytes)
  if len(data) != count:
    raise FormatError(f"{info.file}: tensor {info.name!r}: read {len(data)} of {count} bytes")
  out = np.frombuffer(data, info.dtype)
  return out.reshape((stop - start, *shape[1:]) if shape else ())


def header_bytes(entries: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> bytes:
  """The 8-byte length and the JSON header for tensors written in the given order."""
  header, offset = {}, 0
  if metadata:
    header["__metadata__"] = metadata
  for name, dtype, shape in entries:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return len(text).to_bytes(8, "little") + text


def write(path: str, tensors: Iterator[tuple[str, np.ndarray]] | dict[str, np.ndarray],
          entries: list[tuple[str, np.dtype, tuple[int, ...]]] | None = None,
          metadata: dict[str, str] | None = None) -> int:
  """Write one file a tensor at a time, atomically; returns the tensor bytes."""
  if isinstance(tensors, dict):
    entries = [(k, v.dtype, v.shape) for k, v in tensors.items()] if entries is None else entries
    tensors = iter(tensors.items())
  tmp = f"{path}.partial"
  total = 0
  try:
    with open(tmp, "wb") as f:
      f.write(header_bytes(entries, metadata))
      for (name, dtype, shape), (got, array) in zip(entries, tensors, strict=True):
        array = np.asarray(array)    # tobytes() writes C order whatever the strides
        if got != name or array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
          raise ValueError(f"{path}: expected {name} {np.dtype(dtype)} {list(shape)}, got "
                           f"{got} {array.dtype} {list(array.shape)}")
        f.write(array.tobytes())
        total += array.nbytes
  except BaseException:
    os.remove(tmp)
    raise
  os.replace(tmp, path)
  return total


def read_index(directory: str) -> dict[str, str]:
  """name -> file from the index (or the lone model.safetensors); FormatError if missing."""
  index = os.path.join(directory, INDEX)
  if not os.path.exists(index):
    single = os.path.join(directory, "model.safetensors")
    if not os.path.exists(single):
      raise FormatError(f"{directory}: neither {INDEX} nor model.safetensors")
    return {name: single for name in read_header(single)[0]}
  with open(index) as f:
    try:
      weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise FormatError(f"{index}: no weight_map ({e})") from None
  files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
  for file in sorted(set(files.values())):
    if not os.path.exists(file):
      raise FormatError(f"{index} names {os.path.basename(file)}, which is missing")
  return files


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)

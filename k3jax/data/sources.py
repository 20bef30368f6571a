"""Documents from files chosen by glob patterns: the entries of `data.sources` (source="files").

Each entry: paths (globs, "**" recurses), format ("text" | "jsonl" | "parquet" |
"arrayrecord"), weight (share of training pieces, 1.0), text_field (jsonl, "text"), column
(parquet, "text"), separator (text: "" one document a file), validation_paths (held-out
files; else every `data.heldout_every`-th document). Text formats (.gz too, local or URLs)
are tokenized at start; "arrayrecord" reads `k3jax.data.prepare` shards lazily."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator, Sequence

from k3jax import paths

FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
TEXT_FORMATS = ("text", "jsonl", "parquet")
SOURCE_DEFAULTS = {
    "paths": (),
    "format": "",
    "weight": 1.0,
    "text_field": "text",
    "column": "text",
    "separator": "",
    "validation_paths": (),
}


def source_spec(entry, index: int) -> dict:
  """Entry `index` of `config.data.sources` with every field; ValueError names a bad one."""
  where = f"config.data.sources[{index}]"
  if not hasattr(entry, "keys"):
    raise ValueError(f"{where} must be a dict with 'paths' and 'format', got {entry!r}")
  entry = dict(entry)
  unknown = sorted(set(entry) - set(SOURCE_DEFAULTS))
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown} (known: {sorted(SOURCE_DEFAULTS)})")
  spec = {**SOURCE_DEFAULTS, **entry}
  spec["paths"] = _patterns(spec["paths"])
  spec["validation_paths"] = _patterns(spec["validation_paths"])
  if not spec["paths"]:
    raise ValueError(f"{where}.paths: no glob pattern given")
  if spec["format"] not in FORMATS:
    raise ValueError(f"{where}.format must be one of {FORMATS}, got {spec['format']!r}")
  weight = spec["weight"]
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
    raise ValueError(f"{where}.weight must be a positive number, got {weight!r}")
  for key in ("text_field", "column", "separator"):
    if not isinstance(spec[key], str):
      raise ValueError(f"{where}.{key} must be a string, got {spec[key]!r}")
  return spec


def _patterns(paths) -> tuple[str, ...]:
  if isinstance(paths, str):
    return (paths,) if paths else ()
  return tuple(paths)


def expand_paths(patterns: Sequence[str], field: str) -> list[str]:
  """Files matching each pattern, sorted, each once; FileNotFoundError naming `field`."""
  files, seen = [], set()
  for pattern in patterns:
    matched = [p for p in paths.glob(pattern) if paths.is_file(p)]
    if not matched:
      raise FileNotFoundError(f"{field}: no file matches {pattern!r}")
    for p in matched:
      if p not in seen:
        seen.add(p)
        files.append(p)
  return files


def read_documents(path: str, spec: dict) -> Iterator[str]:
  """The documents of one text-format file; ValueError naming the file if bad."""
  fmt = spec["format"]
  if fmt == "text":
    yield from _text_documents(path, spec["separator"])
  elif fmt == "jsonl":
    yield from _jsonl_documents(path, spec["text_field"])
  elif fmt == "parquet":
    yield from _parquet_documents(path, spec["column"])
  else:
    raise ValueError(f"{path}: format {fmt!r} holds token ids, not text")


@contextlib.contextmanager
def _open_bytes(path: str):
  with paths.path(path).open("rb") as raw:
    if path.endswith(".gz"):
      with gzip.GzipFile(fileobj=raw, mode="rb") as f:
        yield f
    else:
      yield raw


def _read_bytes(path: str) -> bytes:
  with _open_bytes(path) as f:
    return f.read()


def _decode(data: bytes, path: str, offset: int = 0, line: int | None = None) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    where = f"{path}:{line}" if line is not None else path
    raise ValueError(f"{where}: byte offset {offset + e.start}: not UTF-8 "
                     f"({data[e.start:e.start + 4]!r}: {e.reason})") from None


def _text_documents(path: str, separator: str) -> Iterator[str]:
  data = _read_bytes(path)
  if not data:
    raise ValueError(f"{path}: empty file")
  text = _decode(data, path)
  parts = text.split(separator) if separator else [text]
  yield from (p for p in parts if p)


def _jsonl_documents(path: str, field: str) -> Iterator[str]:
  empty, offset = True, 0
  with _open_bytes(path) as f:
    for lineno, raw in enumerate(f, 1):
      start, offset = offset, offset + len(raw)
      if not raw.strip():
        continue
      empty = False
      line = _decode(raw, path, start, lineno)
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not JSON ({e.msg}, column {e.colno})") from None
      if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}:{lineno}: no field {field!r} (has {keys}); the source's "
                         f"text_field (--text_field for prepare) names it")
      text = obj[field]
      if not isinstance(text, str):
        raise ValueError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not text")
      if text:
        yield text
  if empty:
    raise ValueError(f"{path}: empty file (no JSON lines)")


def _parquet_documents(path: str, column: str) -> Iterator[str]:
  with paths.path(path).open("rb") as raw:
    yield from _parquet_rows(raw, path, column)


def _parquet_rows(raw, path: str, column: str) -> Iterator[str]:
  import pyarrow.parquet as pq  # noqa: PLC0415  (only needed for this format)
  try:
    f = pq.ParquetFile(raw)
  except Exception as e:
    raise ValueError(f"{path}: not a Parquet file ({e})") from e
  names = f.schema_arrow.names
  if column not in names:
    raise ValueError(f"{path}: no column {column!r} (columns: {names}); set column in "
                     f"config.data.sources")
  if f.metadata.num_rows == 0:
    raise ValueError(f"{path}: empty file (no rows)")
  row = 0
  for batch in f.iter_batches(columns=[column], batch_size=1024):
    for value in batch.column(0).to_pylist():
      if value is None:
        raise ValueError(f"{path}: row {row}: column {column!r} is null")
      if isinstance(value, bytes):
        value = _decode(value, f"{path}: row {row}")
      elif not isinstance(value, str):
        raise ValueError(f"{path}: row {row}: column {column!r} holds "
                         f"{type(value).__name__}, not text")
      row += 1
      if value:
        yield value

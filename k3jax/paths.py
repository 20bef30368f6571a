"""Local paths and object-store URLs for workdirs, metrics and data, through `etils.epath`.

  path("gs://bucket/run") / "metrics.jsonl";  glob("gs://bucket/data/*.txt")   # sorted

Object stores have no append, no free-space figure and no `**` glob."""

from __future__ import annotations

import glob as glob_lib
import os

from etils import epath

_MAGIC = "*?["


def is_url(p: epath.PathLike) -> bool:
  """Whether `p` names an object-store URL (`scheme://...`) rather than a local path."""
  return "://" in os.fspath(p)


def path(p: epath.PathLike, *, absolute: bool = False) -> epath.Path:
  """`p` as an epath.Path, `~` expanded (absolute with `absolute`)."""
  if isinstance(p, epath.Path) and is_url(p):
    return p
  s = os.fspath(p)
  if is_url(s):
    return epath.Path(s)
  s = os.path.expanduser(s)
  return epath.Path(os.path.abspath(s) if absolute else s)


def glob(pattern: str) -> list[str]:
  """Paths matching `pattern`, sorted (URLs: no `**`)."""
  if not is_url(pattern):
    return sorted(glob_lib.glob(os.path.expanduser(pattern), recursive=True))
  first = min((i for i in (pattern.find(c) for c in _MAGIC) if i >= 0), default=-1)
  if first < 0:
    return [pattern] if epath.Path(pattern).exists() else []
  cut = pattern.rfind("/", 0, first)
  base, rest = pattern[:cut], pattern[cut + 1:]
  if "**" in rest:
    raise ValueError(f"{pattern!r}: '**' is not supported on object stores (one listing per "
                     f"directory level); name the levels with '*'")
  return sorted(os.fspath(p) for p in epath.Path(base).glob(rest))


def is_file(p: str) -> bool:
  """Whether `p` (local path or URL) is an existing file, not a directory."""
  q = path(p)
  return q.exists() and not q.is_dir()


def mtime(p: str) -> float:
  """Modification time of `p` in seconds (local: os.path's, sub-second; URL: epath's)."""
  if not is_url(p):
    return os.path.getmtime(p)
  return float(epath.Path(p).stat().mtime)

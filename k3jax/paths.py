"""One path layer for workdirs, metrics and data files: local paths and object-store URLs.

Everything goes through `etils.epath` (Orbax's own path type). A URL (`gs://`, `s3://`,
`az://`, `hf://`: the schemes epath knows) is kept as it is; a local path has its `~`
expanded. epath reads `gs://` through TensorFlow's gfile when TensorFlow is installed, else
through fsspec, which needs `gcsfs` (`s3fs`, `adlfs`) at use time, not at import.

  path("gs://bucket/run") / "metrics.jsonl"     # epath.Path('gs://bucket/run/metrics.jsonl')
  path("runs/x", absolute=True)                 # epath.Path('/cwd/runs/x')
  glob("gs://bucket/data/*.txt")                # ['gs://bucket/data/a.txt', ...], sorted

Object stores differ from a disk: no append mode (a write replaces the whole object), no
free-space figure, and epath refuses a recursive `**` glob on them (one listing per level
of a bucket could be thousands of requests).
"""

from __future__ import annotations

import glob as glob_lib
import os

from etils import epath

_MAGIC = "*?["   # glob wildcards


def is_url(p: epath.PathLike) -> bool:
  """Whether `p` names an object-store URL (`scheme://...`) rather than a local path."""
  return "://" in os.fspath(p)


def path(p: epath.PathLike, *, absolute: bool = False) -> epath.Path:
  """`p` as an epath.Path: a URL unchanged, a local path with `~` expanded (and made
  absolute with `absolute`: Orbax's tensorstore writer refuses relative paths)."""
  if isinstance(p, epath.Path) and is_url(p):
    return p
  s = os.fspath(p)
  if is_url(s):
    return epath.Path(s)
  s = os.path.expanduser(s)
  return epath.Path(os.path.abspath(s) if absolute else s)


def glob(pattern: str) -> list[str]:
  """Paths matching `pattern`, sorted. Local: Python's glob (`**` recurses, `~` expands).
  URL: epath's glob from the deepest directory without wildcards (no `**`); a URL without
  wildcards matches itself if it exists."""
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

"""One checksum per saved array, of its global value whatever the sharding (`checksums`),
and where its bytes lie in a step's files (`array_locations`), for `k3jax.checkpoint`."""

from __future__ import annotations

import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath


def path_str(path) -> str:
  """A pytree key path as "params/w" (the name checksums and messages use)."""
  return "/".join(_key_name(k) for k in path)


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


CHECKSUM_FORMAT = "k3jax-checksum-1"
_U32 = np.uint32
_COL_SEED, _ROW_SEED, _PHI = 0x243F6A88, 0x85A308D3, 0x9E3779B9


def _fmix32(h):
  """murmur3's 32-bit finalizer on uint32 arrays (NumPy or JAX)."""
  h = h ^ (h >> 16)
  h = h * _U32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * _U32(0xC2B2AE35)
  return h ^ (h >> 16)


def _col_weights(j):
  return _fmix32(j + _U32(_COL_SEED)) | _U32(1)


def _row_keys(r):
  return _fmix32(r * _U32(_PHI) + _U32(_ROW_SEED))


def _bit_width(dtype) -> int | None:
  """Bits per element of a covered dtype; None for others (complex, strings)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return 8
  try:
    bits = (jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating)
            else jnp.iinfo(dtype).bits)
  except ValueError:
    return None
  return bits if bits in (4, 8, 16, 32, 64) else None


def _words_np(a: np.ndarray) -> np.ndarray:
  """`a`'s bits as unsigned words [*lead, cols], a view where the dtype allows."""
  a = np.ascontiguousarray(a).reshape(a.shape or (1,))
  bits = _bit_width(a.dtype)
  if a.dtype == np.bool_ or bits == 8:
    return a.view(np.uint8)
  if bits == 4:   # one element per byte, its 4 bits the low ones
    return a.view(np.uint8) & np.uint8(0xF)
  return a.view(np.uint16 if bits == 16 else np.uint32)


def _words_jnp(x: jax.Array) -> jax.Array:
  x = x.reshape(x.shape or (1,))
  bits = _bit_width(x.dtype)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if bits == 64:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)   # [..., n, 2], low word first
    return w.reshape(*x.shape[:-1], 2 * x.shape[-1])
  u = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
  return jax.lax.bitcast_convert_type(x, u).astype(jnp.uint32)


def _checksum_jnp(x: jax.Array) -> jax.Array:
  w = _words_jnp(x)
  lead = w.shape[:-1]
  p = jnp.sum(w * _col_weights(jax.lax.iota(jnp.uint32, w.shape[-1])), axis=-1,
              dtype=jnp.uint32)   # [*lead]
  r = jnp.zeros(lead, jnp.uint32)
  for d, n in enumerate(lead):
    r = r * _U32(n) + jax.lax.broadcasted_iota(jnp.uint32, lead, d)
  return jnp.sum(_fmix32(p ^ _row_keys(r)), dtype=jnp.uint32)


@jax.jit
def _device_checksums(xs: tuple) -> tuple:
  return tuple(_checksum_jnp(x) for x in xs)


def _checksum_np(shape: tuple, dtype, boxes) -> int:
  """The checksum of global `shape` from host `boxes` (index, data) that tile it once."""
  k = 2 if _bit_width(dtype) == 64 else 1
  lead = tuple(shape[:-1])
  sums = None   # P [rows], when the boxes split the array
  for index, data in boxes:
    w = _words_np(data)
    c0 = (index[-1].start or 0) * k if index else 0
    p = np.einsum("...j,j->...", w, _col_weights(np.arange(c0, c0 + w.shape[-1],
                                                           dtype=_U32)))
    if w.shape == (*lead, (shape[-1] if shape else 1) * k):
      sums = p.reshape(-1)
      break
    if sums is None:
      sums = np.zeros(int(np.prod(lead)), _U32)
    rows = np.ravel_multi_index(np.ix_(*[np.arange((s.start or 0), (s.start or 0) + n)
                                         for s, n in zip(index, w.shape[:-1])]), lead)
    sums[rows.reshape(-1)] += p.reshape(-1)
  rows = np.arange(sums.size, dtype=_U32)
  return int(np.sum(_fmix32(sums ^ _row_keys(rows)), dtype=_U32))


def _device_key(x: jax.Array) -> tuple:
  """The ordered device assignment of `x`: arrays that share it can go in one jit call."""
  return tuple(d.id for d in x.sharding._device_assignment)


def checksums(tree) -> dict[str, dict]:
  """{tree path: {"checksum", "dtype", "shape"}} per array leaf of `tree`, of its global
  value whatever the sharding: its bits as uint32 words W [rows, cols], then

    P[r] = sum_j W[r, j] * a[j]            mod 2^32   a[j] = fmix32(j + seed) | 1 (odd)
    checksum = sum_r fmix32(P[r] ^ b[r])   mod 2^32   b[r] = fmix32(r * phi + seed)

  (fmix32: murmur3's finalizer; misses ~2^-32). Every process must call it."""
  out, on_device = {}, {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, (np.ndarray, np.generic)):
      x = np.asarray(x)
    elif not isinstance(x, jax.Array):
      continue
    if _bit_width(x.dtype) is None:
      continue
    key = path_str(path)
    out[key] = {"checksum": None, "dtype": str(x.dtype), "shape": list(x.shape)}
    if isinstance(x, np.ndarray):
      out[key]["checksum"] = _checksum_np(x.shape, x.dtype, [((), x)])
    elif x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set):
      boxes = [(s.index, np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
      out[key]["checksum"] = _checksum_np(x.shape, x.dtype, boxes)
    else:
      on_device.setdefault(_device_key(x), []).append((key, x))
  for group in on_device.values():
    sums = _device_checksums(tuple(x for _, x in group))
    for (key, _), s in zip(group, sums):
      out[key]["checksum"] = int(np.asarray(s))
  return out


def array_locations(step_dir: epath.PathLike) -> dict[str, list[tuple[str, int, int]]]:
  """{tree path: [(file, offset, length)]} of a step's state; {} if unreadable."""
  try:
    import tensorstore as ts  # noqa: PLC0415  (orbax's storage layer; only read here)
    state = os.fspath(epath.Path(step_dir) / "state")
    if not os.path.isdir(state):
      return {}
    kv = ts.KvStore.open({"driver": "file", "path": state + "/"}).result()

    def where(location: str):   # "value:<prefix>:<file>:<offset>:<length>"
      _, prefix, name, offset, length = location.split(":")
      return f"state/{prefix}{name}", int(offset), int(length)

    out: dict[str, list] = {}
    manifest = ts.ocdbt.dump(kv).result()
    todo = [v["root"]["location"] for v in manifest.get("versions", [])[-1:]
            if v.get("root", {}).get("location")]
    while todo:
      location = todo.pop()
      for entry in ts.ocdbt.dump(kv, location).result().get("entries", []):
        for value in entry.values():
          if isinstance(value, str) and value.startswith("btreenode:"):
            todo.append(value)
        key = entry.get("key", b"")
        key = (key if isinstance(key, bytes) else ast.literal_eval(key)).decode()
        name, _, chunk = key.partition("/")
        if not chunk or chunk.rsplit("/", 1)[-1].startswith((".z", "zarr.json")):
          continue
        path = name.replace(".", "/")
        if "indirect_value" in entry:
          out.setdefault(path, []).append(where(entry["indirect_value"]))
        elif "inline_value" in entry:
          out.setdefault(path, []).append((where(location)[0], -1, -1))
    return out
  except Exception:  # noqa: BLE001  (a best-effort pointer for a message)
    return {}

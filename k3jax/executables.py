"""Compiled programs kept on disk, so that a rerun skips tracing and lowering as well as XLA.

JAX's persistent compilation cache keys a program by its lowered form, so a rerun still
traces and lowers it before the cache answers. Here the key is what decides the program
before any tracing: the program's config fields (`program.program_key`), the mesh and its
devices, the versions of the libraries that trace it, jax's flags, XLA's environment and the
source of k3jax and pallas_kernels. A stored executable that cannot be read is moved aside
(`<file>.unreadable`) and the program compiled again; one that JAX's cache answered is not
stored.

  compiled, loaded = load_or_compile("train_step", lower, fields=program_key(cfg),
                                     mesh=mesh, directory=cache_dir)"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax import monitoring
from jax.experimental import serialize_executable

from pallas_kernels.platform import load_runtimes

FORMAT = 1
# jax flags that name where and whether to cache or log, not what a program computes
_NOT_KEYED = ("jax_compilation_cache", "jax_persistent_cache", "jax_log_compiles",
              "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules",
              "jax_pprint_use_color", "jax_traceback_filtering")
_LIBRARIES = ("jax", "jaxlib", "flax", "optax")
_PACKAGES = ("k3jax", "pallas_kernels")
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def source_digest() -> str:
  """sha256 over the .py files of k3jax and pallas_kernels (path and bytes)."""
  h = hashlib.sha256()
  for package in _PACKAGES:
    root = Path(__import__(package).__file__).parent
    for path in sorted(root.rglob("*.py")):
      h.update(path.relative_to(root.parent).as_posix().encode())
      h.update(path.read_bytes())
  return h.hexdigest()


def key(program_fields: str, mesh) -> str:
  """The hex key of the program `program_fields` describes on `mesh` in this process."""
  devices = list(mesh.devices.flat)
  parts = {
      "format": FORMAT, "program": program_fields,
      "mesh": [list(mesh.axis_names), list(mesh.devices.shape), [d.id for d in devices]],
      "devices": sorted({(d.platform, d.device_kind) for d in devices}),
      "platform_version": devices[0].client.platform_version,
      "process": [jax.process_index(), jax.process_count()],
      "libraries": {name: importlib.metadata.version(name) for name in _LIBRARIES},
      "flags": {k: v for k, v in jax.config.values.items() if not k.startswith(_NOT_KEYED)},
      "environment": {name: os.environ.get(name) for name in _ENVIRONMENT},
      "source": source_digest(),
  }
  text = json.dumps(parts, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()


def load_or_compile(name: str, lower: Callable[[], jax.stages.Lowered], *, fields: str, mesh,
                    directory: str | os.PathLike | None,
                    log: Callable[[str], None] = print) -> tuple[jax.stages.Compiled, bool]:
  """(executable, whether it was loaded): the one stored under `directory` for the program
  `fields` describes on `mesh`, or `lower().compile()`, then stored there. directory None:
  compile, store nothing."""
  if directory is None:
    return lower().compile(), False
  hex_key = key(fields, mesh)
  path = Path(directory) / "executables" / f"{name}-{hex_key[:40]}.pkl"
  if path.exists():
    t0 = time.time()
    try:
      compiled = _load(path, hex_key, list(mesh.devices.flat))
    except Exception as e:  # noqa: BLE001  (unpickling and the runtime raise many types)
      aside = path.with_name(path.name + ".unreadable")
      os.replace(path, aside)
      log(f"compile: the stored {name} in {path} could not be loaded "
          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); moved to "
          f"{aside.name}, compiling")
    else:
      log(f"compile: {name} loaded from {path} in {time.time() - t0:.1f} s")
      return compiled, True
  compiled, from_jax_cache = _compile(lower)
  if from_jax_cache:
    # re-serialized, such an executable loses its compiled functions on CPU (they fail at
    # run time, not at load); unproven elsewhere, so it is not stored
    log(f"compile: {name} came from JAX's compilation cache; not stored")
    return compiled, False
  try:
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
  except (ValueError, NotImplementedError) as e:   # what JAX cannot serialize yet
    log(f"compile: {name} cannot be stored ({e}); a rerun compiles it again")
    return compiled, False
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
  with open(partial, "wb") as f:
    pickle.dump({"format": FORMAT, "name": name, "key": hex_key, "executable": blob,
                 "in_tree": in_tree, "out_tree": out_tree}, f, protocol=pickle.HIGHEST_PROTOCOL)
  os.replace(partial, path)
  return compiled, False


def _compile(lower) -> tuple[jax.stages.Compiled, bool]:
  """(lower().compile(), whether JAX's persistent cache answered it)."""
  hits = []

  def listen(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      hits.append(event)

  monitoring.register_event_listener(listen)
  try:
    return lower().compile(), bool(hits)
  finally:
    monitoring.unregister_event_listener(listen)


def _load(path: Path, hex_key: str, devices) -> jax.stages.Compiled:
  load_runtimes(devices[0].platform)
  with open(path, "rb") as f:
    stored = pickle.load(f)
  if not isinstance(stored, dict) or stored.get("format") != FORMAT:
    raise ValueError(f"not an executable of format {FORMAT}")
  if stored.get("key") != hex_key:
    raise ValueError("stored for another program (its key differs)")
  return serialize_executable.deserialize_and_load(
      stored["executable"], stored["in_tree"], stored["out_tree"], backend=devices[0].client,
      execution_devices=devices)

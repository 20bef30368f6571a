"""Checkpoints of a training run: the train state, the data iterator state and the config.

A `Checkpointer` wraps orbax's CheckpointManager over `<workdir>/checkpoints`; steps hold
state, data, config, progress and checksums. Only finalized steps are seen. With `async_save`
call `wait()` or `close()` before exiting. `restore_latest` moves damaged steps aside.

  ckpt = Checkpointer(workdir, keep=3, save_every=cfg.train.checkpoint_every)
  got = ckpt.restore_latest(abstract_state, config_json=cfg.to_json(), must_match=(...))
  ckpt.save(step, state, data_iter.get_state(), cfg.to_json())   # no-op between intervals
  ckpt.close()"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from k3jax import paths
from k3jax.checksums import CHECKSUM_FORMAT, array_locations, checksums, path_str

DataState = dict | bytes | None
COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, before the final rename
CORRUPT_SUFFIX = ".corrupt"


class IncompatibleCheckpoint(ValueError):
  """A checkpoint saved under a config that disagrees on a field the state depends on."""


class DamagedCheckpoint(ValueError):
  """A checkpoint step whose restored arrays differ from the checksums recorded at save."""


class _Unreadable(Exception):
  """A checkpoint step whose files are partial or damaged."""


class Restored(NamedTuple):
  step: int
  state: Any
  data: DataState
  progress: dict | None


def check_writable(directory: epath.PathLike) -> epath.Path:
  """Create `directory` and write and remove a probe file; OSError naming it on failure."""
  path = epath.Path(directory)
  probe = path / f".write_probe.{jax.process_index()}.{os.getpid()}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()
  except Exception as e:  # noqa: BLE001  (any filesystem backend's error)
    raise OSError(f"checkpoint directory {str(path)!r} is not writable: "
                  f"{type(e).__name__}: {e}") from e
  return path


def check_free_space(directory: epath.PathLike, nbytes: int) -> None:
  """OSError naming `directory` if it has less than `nbytes` free (not for URLs)."""
  if paths.is_url(directory):
    return
  try:
    free = shutil.disk_usage(os.fspath(directory)).free
  except (OSError, TypeError):
    return
  if free < nbytes:
    raise OSError(f"checkpoint directory {str(directory)!r} has {free / 2**30:.2f} GiB free; "
                  f"a checkpoint needs {nbytes / 2**30:.2f} GiB")


def _encode_data_state(state: DataState):
  if state is None or isinstance(state, dict):
    return {"kind": "dict", "value": state}
  if isinstance(state, (bytes, bytearray)):
    return {"kind": "bytes", "value": base64.b64encode(bytes(state)).decode("ascii")}
  raise TypeError(f"data_iter_state must be a dict, bytes or None, got {type(state).__name__}")


def _decode_data_state(obj) -> DataState:
  if obj["kind"] == "bytes":
    return base64.b64decode(obj["value"])
  return obj["value"]


def _json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON-serializable in the data iterator state: {type(x).__name__}")


def _flat_shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(p): tuple(getattr(x, "shape", np.shape(x))) for p, x in leaves}


def check_shapes(stored: Any, target: Any, *, where: str = "checkpoint") -> None:
  """ValueError naming every parameter path whose shape (or presence) differs."""
  have, want = _flat_shapes(stored), _flat_shapes(target)
  problems = [f"  {p}: stored {have[p]}, target {want[p]}"
              for p in want if p in have and have[p] != want[p]]
  problems += [f"  {p}: missing from the {where} (target {want[p]})"
               for p in want if p not in have]
  problems += [f"  {p}: in the {where} {have[p]} but not in the target"
               for p in have if p not in want]
  if problems:
    shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"]
                             if len(problems) > 20 else [])
    raise ValueError(f"{where} does not match the restore target:\n" + "\n".join(shown))


def _field(cfg: dict, dotted: str):
  for key in dotted.split("."):
    if not isinstance(cfg, dict) or key not in cfg:
      return "(absent)"
    cfg = cfg[key]
  return cfg


def check_config(stored: dict, current: dict, fields, *, where: str = "checkpoint") -> None:
  """IncompatibleCheckpoint naming every dotted field whose value differs."""
  diff = [f"config.{f}: {_field(stored, f)!r} in the {where}, {_field(current, f)!r} now"
          for f in fields if _field(stored, f) != _field(current, f)]
  if diff:
    raise IncompatibleCheckpoint(
        f"the {where} was saved with an incompatible config (restore needs these fields "
        f"unchanged; use a new workdir to start over):\n  " + "\n  ".join(diff))


def _short(e: Exception) -> str:
  """The first line of an exception (tensorstore's run to pages), at most 200 characters."""
  first = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:200]}"


def _state_handler(compress: bool) -> ocp.StandardCheckpointHandler:
  """orbax's StandardCheckpointHandler, zstd optional; either setting reads both."""
  handler = ocp.StandardCheckpointHandler()
  if not compress:
    if not isinstance(getattr(handler, "_impl", None), ocp.PyTreeCheckpointHandler):
      raise NotImplementedError(f"Checkpointer(compress=False): orbax {ocp.__version__}'s "
                                "StandardCheckpointHandler has no PyTree handler to set")
    handler._impl = ocp.PyTreeCheckpointHandler(use_compression=False)
  return handler




def restore_params(workdir: str, abstract_state: tuple, *, config_json: str, must_match=(),
                   field: str = "workdir"):
  """(step, params, rest) of the latest run or weights checkpoint in `workdir`, read into
  `abstract_state` (params, rest, opt_state) without the optimizer state.
  FileNotFoundError naming `field` when there is no checkpoint."""
  if not paths.path(workdir).exists():
    raise FileNotFoundError(f"{field}: {workdir!r} does not exist")
  ckpt = Checkpointer(workdir, keep=1)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise FileNotFoundError(f"{field}: no checkpoint in {workdir!r}")
    abstract = abstract_state if ckpt.holds_data(step) else abstract_state[:2]
    got = ckpt.restore_latest(abstract, config_json=config_json, must_match=must_match)
  finally:
    ckpt.close()
  return got.step, got.state[0], got.state[1]


class Checkpointer:
  """Saves and restores train state, data iterator state and config under a workdir."""

  STATE, DATA, CONFIG, PROGRESS = "state", "data", "config", "progress"
  CHECKSUMS = "checksums"

  def __init__(self, workdir: epath.PathLike, *, keep: int | None = 3,
               keep_every: int | None = None, save_every: int = 1, async_save: bool = True,
               compress: bool = True, checksums: bool = True):
    """`keep`: newest steps kept (None or <= 0: all); `keep_every`: multiples of it kept
    for good (must divide by `save_every`); `save_every`: unforced saves only on its
    multiples; `compress`: zstd per array; `checksums`: record one per array."""
    if save_every < 1:
      raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
    keep_every = keep_every if keep_every and keep_every > 0 else None
    if keep_every is not None and keep_every % save_every:
      raise ValueError(f"Checkpointer: keep_every={keep_every} is not a multiple of "
                       f"save_every={save_every}: only steps that are multiples of "
                       f"{np.lcm(keep_every, save_every)} would be kept")
    self.save_every, self.keep_every, self.record_checksums = save_every, keep_every, checksums
    # Absolute: orbax's tensorstore writer refuses relative local paths.
    self.directory = check_writable(paths.path(workdir, absolute=True) / "checkpoints")
    policies = [ocp.checkpoint_managers.LatestN(n=keep if keep and keep > 0 else None)]
    if keep_every is not None:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        save_interval_steps=1,   # `save` decides (orbax would also save the first step)
        enable_async_checkpointing=async_save,
        create=True,
        cleanup_tmp_directories=True,
    )
    self._mgr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={self.STATE: _state_handler(compress),
                       self.DATA: ocp.JsonCheckpointHandler(),
                       self.CONFIG: ocp.JsonCheckpointHandler(),
                       self.PROGRESS: ocp.JsonCheckpointHandler(),
                       self.CHECKSUMS: ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    """Finalized steps, ascending."""
    return sorted(self._mgr.all_steps())

  def latest_step(self) -> int | None:
    """The newest finalized step, or None if there is none."""
    return self._mgr.latest_step()

  def should_save(self, step: int) -> bool:
    """Whether an unforced `save(step, ...)` writes."""
    if step in self._mgr.all_steps():
      return False
    return step % self.save_every == 0 or self._mgr.reached_preemption(step)

  def reached_preemption(self, step: int) -> bool:
    """True when the cluster signalled a preemption: save now (force=True) and exit."""
    return self._mgr.reached_preemption(step)

  def save(self, step: int, state: Any, data_iter_state: DataState = None,
           config_json: str | None = None, *, progress: dict | None = None,
           force: bool = False) -> bool:
    """Save `step` if `should_save(step)` or `force`, once; returns whether a save started."""
    if step in self._mgr.all_steps() or not (force or self.should_save(step)):
      return False
    items = {self.STATE: ocp.args.StandardSave(state)}
    if self.record_checksums:
      items[self.CHECKSUMS] = ocp.args.JsonSave({"format": CHECKSUM_FORMAT,
                                                 "arrays": checksums(state)})
    if data_iter_state is not None:
      encoded = json.loads(json.dumps(_encode_data_state(data_iter_state),
                                      default=_json_default))
      items[self.DATA] = ocp.args.JsonSave(encoded)
    if config_json is not None:
      items[self.CONFIG] = ocp.args.JsonSave(json.loads(config_json))
    if progress is not None:
      items[self.PROGRESS] = ocp.args.JsonSave(dict(progress))
    return self._mgr.save(step, args=ocp.args.Composite(**items), force=True)

  def holds_data(self, step: int) -> bool:
    """Whether `step` holds a data-iterator state (weights checkpoints do not)."""
    return self._has_item(step, self.DATA)

  def _has_item(self, step: int, name: str) -> bool:
    return (self.directory / str(step) / name).exists()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, DataState]:
    """(state, data) of `step` into `abstract_state` (any mesh); checks shapes, checksums."""
    self.wait()
    if step not in self._mgr.all_steps():
      raise FileNotFoundError(f"no finalized checkpoint for step {step} in "
                              f"{str(self.directory)!r} (have {self.all_steps()})")
    stored = self._mgr.item_metadata(step)[self.STATE]
    check_shapes(getattr(stored, "tree", stored), abstract_state,
                 where=f"checkpoint {str(self.directory / str(step))!r}")
    items = {self.STATE: ocp.args.StandardRestore(abstract_state)}
    has_data = self._has_item(step, self.DATA)
    if has_data:
      items[self.DATA] = ocp.args.JsonRestore()
    if self._has_item(step, self.CHECKSUMS):
      items[self.CHECKSUMS] = ocp.args.JsonRestore()
    restored = self._mgr.restore(step, args=ocp.args.Composite(**items))
    if self.CHECKSUMS in items:
      self._verify(step, restored[self.STATE], restored[self.CHECKSUMS])
    data = _decode_data_state(restored[self.DATA]) if has_data else None
    return restored[self.STATE], data

  def _verify(self, step: int, state: Any, stored) -> None:
    """DamagedCheckpoint naming each array that differs from its checksum in `stored`."""
    path = self.directory / str(step)
    if not isinstance(stored, dict) or stored.get("format") != CHECKSUM_FORMAT:
      raise DamagedCheckpoint(f"checkpoint {str(path)!r}: checksums item is not "
                              f"{CHECKSUM_FORMAT!r}: {str(stored)[:100]}")
    want, got = stored.get("arrays") or {}, checksums(state)
    try:
      bad = [k for k, g in got.items() if k in want and want[k]["dtype"] == g["dtype"]
             and want[k]["checksum"] != g["checksum"]]
    except (KeyError, TypeError) as e:
      raise DamagedCheckpoint(f"checkpoint {str(path)!r}: checksums item garbled: "
                              f"{type(e).__name__}: {e}") from e
    if bad:
      where = array_locations(path)
      names = [k + (f" ({', '.join(sorted({f for f, _, _ in where[k]}))})" if where.get(k)
                    else "") for k in bad]
      raise DamagedCheckpoint(
          f"checkpoint {str(path)!r}: {len(bad)} array(s) differ from their checksums "
          f"recorded at save: " + "; ".join(names[:10])
          + (f"; and {len(bad) - 10} more" if len(bad) > 10 else ""))

  def restore_latest(self, abstract_state: Any, *, config_json: str | None = None,
                     must_match=()) -> Restored | None:
    """The newest readable step as Restored, or None if there is none. Damaged steps are
    moved aside to `<step>.corrupt`; the config must agree on `must_match`.
    FileNotFoundError when steps exist but none is readable."""
    self.wait()
    bad = []
    for step in reversed(self.all_steps()):
      try:
        got = self._restore_checked(step, abstract_state, config_json, must_match)
      except _Unreadable as e:
        bad.append(f"step {step} ({e})")
        self._move_aside(step)
        continue
      if bad:
        logging.warning("checkpoint: %s: damaged, moved aside to <step>%s; restored step %d "
                        "from %s instead", "; ".join(bad), CORRUPT_SUFFIX, step,
                        self.directory)
      return got
    aside = sorted(p.name for p in self.directory.glob(f"*{CORRUPT_SUFFIX}*"))
    if bad or aside:
      raise FileNotFoundError(
          f"no readable checkpoint in {str(self.directory)!r}: "
          + "; ".join(bad or [f"unreadable steps moved aside earlier: {', '.join(aside)}"])
          + "; remove the directory (or the *.corrupt ones) to start from scratch")
    return None

  def _restore_checked(self, step, abstract_state, config_json, must_match) -> Restored:
    """Raises _Unreadable for damaged files; mismatches with the target propagate."""
    path = self.directory / str(step)
    where = f"checkpoint {str(path)!r}"
    if not (path / COMMIT_MARKER).exists():
      raise _Unreadable(f"no {COMMIT_MARKER}: the save did not finish")
    if config_json is not None and self._has_item(step, self.CONFIG):
      try:
        stored = json.loads(self.restore_config(step))
      except Exception as e:  # noqa: BLE001  (orbax / json / filesystem)
        raise _Unreadable(f"config: {_short(e)}") from e
      check_config(stored, json.loads(config_json), must_match, where=where)
    try:
      meta = self._mgr.item_metadata(step)[self.STATE]
    except Exception as e:  # noqa: BLE001
      raise _Unreadable(f"state metadata: {_short(e)}") from e
    tree = getattr(meta, "tree", meta)
    if not tree:
      raise _Unreadable("state metadata: missing")
    check_shapes(tree, abstract_state, where=where)
    items = {self.STATE: ocp.args.StandardRestore(abstract_state)}
    for name in (self.DATA, self.PROGRESS, self.CHECKSUMS):
      if self._has_item(step, name):
        items[name] = ocp.args.JsonRestore()
    try:
      got = self._mgr.restore(step, args=ocp.args.Composite(**items))
      state = jax.block_until_ready(got[self.STATE])  # a truncated file fails here, not later
    except Exception as e:  # noqa: BLE001
      raise _Unreadable(_short(e)) from e
    if self.CHECKSUMS in items:
      try:
        self._verify(step, state, got[self.CHECKSUMS])
      except DamagedCheckpoint as e:
        raise _Unreadable(str(e).split(": ", 1)[-1]) from e
    data = _decode_data_state(got[self.DATA]) if self.DATA in items else None
    return Restored(step, state, data, got[self.PROGRESS] if self.PROGRESS in items else None)

  def _move_aside(self, step: int) -> None:
    """Renames a damaged step out of orbax's view (kept for inspection)."""
    if jax.process_index() == 0:
      src = self.directory / str(step)
      dst = self.directory / f"{step}{CORRUPT_SUFFIX}"
      n = 1
      while dst.exists():
        dst, n = self.directory / f"{step}{CORRUPT_SUFFIX}.{n}", n + 1
      src.rename(dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"k3jax checkpoint {step} moved aside")
    self._mgr.reload()

  def restore_config(self, step: int) -> str | None:
    """The config JSON saved with `step`, or None."""
    self.wait()
    if not self._has_item(step, self.CONFIG):
      return None
    restored = self._mgr.restore(
        step, args=ocp.args.Composite(**{self.CONFIG: ocp.args.JsonRestore()}))
    return json.dumps(restored[self.CONFIG])

  def saving(self) -> bool:
    """Whether a started (async) save is still being written."""
    return self._mgr.is_saving_in_progress()

  def wait(self) -> None:
    """Block until every started save is finalized (re-raises a failed async save)."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    """Wait for pending saves and release the manager."""
    self._mgr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

"""Checkpoints of a training run: the train state, the data iterator state and the config.

One `Checkpointer` per run wraps an `orbax.checkpoint.CheckpointManager` over
`<workdir>/checkpoints`. Each step directory holds up to three orbax items:

  state   the train-state pytree (arrays of any dtype and sharding, Python scalars)
  data    the data iterator's `get_state()` (a dict, or bytes stored as base64), as JSON
  config  the experiment config (`cfg.to_json()`), as JSON

Orbax writes a step into a temporary directory and renames it (or, on object stores,
writes `commit_success.txt`) only when every item is complete; `latest_step` and
`restore` see finalized steps only, so a run killed mid-save resumes from the previous one.
With `async_save` the device-to-host copy happens inside `save` and the file writes in a
background thread: the caller may donate or overwrite the saved arrays right after `save`
returns, and must call `wait()` (or `close()`) before the process exits.

  ckpt = Checkpointer(workdir, keep=cfg.train.keep_checkpoints,
                      save_every=cfg.train.checkpoint_every)
  step = ckpt.latest_step()
  if step is not None:
    state, data_state = ckpt.restore(step, abstract_state)   # leaves: ShapeDtypeStruct + sharding
  ...
  ckpt.save(step, state, data_iter.get_state(), cfg.to_json())   # no-op between intervals
  ckpt.close()
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

DataState = dict | bytes | None


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


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path_str(path) -> str:
  return "/".join(_key_name(k) for k in path)


def _flat_shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_path_str(p): tuple(getattr(x, "shape", np.shape(x))) for p, x in leaves}


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


class Checkpointer:
  """Saves and restores train state, data iterator state and config under a workdir."""

  STATE, DATA, CONFIG = "state", "data", "config"

  def __init__(self, workdir: epath.PathLike, *, keep: int | None = 3,
               save_every: int = 1, async_save: bool = True):
    """`keep`: number of newest checkpoints kept (None or <= 0: all); `save_every`: `save`
    writes only steps that are multiples of it (unless forced or preempted). Raises
    OSError naming the directory if it cannot be written."""
    if save_every < 1:
      raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
    self.save_every = save_every
    self.directory = check_writable(epath.Path(workdir) / "checkpoints")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep if keep and keep > 0 else None,
        save_interval_steps=1,   # `save` decides (orbax would also save the first step)
        enable_async_checkpointing=async_save,
        create=True,
    )
    self._mgr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={self.STATE: ocp.StandardCheckpointHandler(),
                       self.DATA: ocp.JsonCheckpointHandler(),
                       self.CONFIG: ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    """Finalized steps, ascending."""
    return sorted(self._mgr.all_steps())

  def latest_step(self) -> int | None:
    """The newest finalized step, or None if there is none."""
    return self._mgr.latest_step()

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` without force writes: `step` is a multiple of
    `save_every` or a preemption was signalled, and `step` is not saved yet."""
    if step in self._mgr.all_steps():
      return False
    return step % self.save_every == 0 or self._mgr.reached_preemption(step)

  def reached_preemption(self, step: int) -> bool:
    """True when the cluster signalled a preemption: save now (force=True) and exit."""
    return self._mgr.reached_preemption(step)

  def save(self, step: int, state: Any, data_iter_state: DataState = None,
           config_json: str | None = None, *, force: bool = False) -> bool:
    """Save `state` (+ the data iterator state and config) at `step` if
    `should_save(step)` or `force`; returns whether a save was started. A step that is
    already saved is skipped even when forced. `step` counts completed updates."""
    if step in self._mgr.all_steps() or not (force or self.should_save(step)):
      return False
    items = {self.STATE: ocp.args.StandardSave(state)}
    if data_iter_state is not None:
      encoded = json.loads(json.dumps(_encode_data_state(data_iter_state),
                                      default=_json_default))
      items[self.DATA] = ocp.args.JsonSave(encoded)
    if config_json is not None:
      items[self.CONFIG] = ocp.args.JsonSave(json.loads(config_json))
    return self._mgr.save(step, args=ocp.args.Composite(**items), force=True)

  def _has_item(self, step: int, name: str) -> bool:
    return (self.directory / str(step) / name).exists()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, DataState]:
    """(state, data_iter_state) of `step`.

    `abstract_state` gives the tree, shapes, dtypes and shardings of the result: leaves
    are `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (e.g. from `jax.eval_shape` or
    `nnx.eval_shape` with shardings attached); arrays are read straight into those
    shardings and cast to those dtypes. A stored shape that differs from the target's
    raises ValueError naming the parameter path and both shapes. data_iter_state is
    None when the step was saved without one.
    """
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
    restored = self._mgr.restore(step, args=ocp.args.Composite(**items))
    data = _decode_data_state(restored[self.DATA]) if has_data else None
    return restored[self.STATE], data

  def restore_config(self, step: int) -> str | None:
    """The config JSON saved with `step`, or None."""
    self.wait()
    if not self._has_item(step, self.CONFIG):
      return None
    restored = self._mgr.restore(
        step, args=ocp.args.Composite(**{self.CONFIG: ocp.args.JsonRestore()}))
    return json.dumps(restored[self.CONFIG])

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

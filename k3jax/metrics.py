"""Training metrics: <workdir>/metrics.jsonl and TensorBoard events (tensorboardX, local only).

`MetricWriter.write_scalars(step, scalars)` appends a JSON line (rewritten whole at `flush()`
on object stores); `resume_step=S` drops records past S. Only process 0 writes (`enabled`)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging
from etils import epath

from k3jax import paths

JSONL_NAME = "metrics.jsonl"
TB_DIR = "tensorboard"


def _scalar(value: Any) -> int | float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric value must be a scalar, got shape {arr.shape}")
  item = arr.reshape(()).item()
  if isinstance(item, bool):
    return int(item)
  if isinstance(item, (int, float)):
    return item
  raise TypeError(f"metric value must be numeric, got {type(item).__name__}")


class MetricWriter:
  """Scalars to `<workdir>/metrics.jsonl` and TensorBoard event files under `<workdir>`."""

  def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True,
               tensorboard: bool = True, resume_step: int | None = None):
    self.enabled = enabled
    workdir = paths.path(workdir)
    self.workdir = os.fspath(workdir)
    self.jsonl_path = os.fspath(workdir / JSONL_NAME)
    self.tb_dir = os.fspath(workdir / TB_DIR)
    self._remote = paths.is_url(workdir)
    self._jsonl = None      # local: the file, opened for appending
    self._lines = None      # remote: every line of the file, rewritten at each flush
    self._tb = None
    if not enabled:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    _drop_partial_line(self.jsonl_path)
    if resume_step is not None:
      _drop_steps_after(self.jsonl_path, resume_step)
    if self._remote:
      jsonl = epath.Path(self.jsonl_path)
      self._lines = jsonl.read_text().splitlines(keepends=True) if jsonl.exists() else []
    else:
      # Line-buffered: each record is one write, so a killed process leaves whole lines.
      self._jsonl = open(self.jsonl_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    if tensorboard and self._remote:
      logging.warning("metrics: TensorBoard events are written for local workdirs only; "
                      "%s gets metrics.jsonl alone", self.workdir)
    elif tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415  (only the writing process)
      purge = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(logdir=self.tb_dir, flush_secs=30, purge_step=purge)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """One record of `scalars` (name -> number, numpy or jax scalar) at `step`."""
    if not self.enabled:
      return
    step = int(step)
    values = {str(k): _scalar(v) for k, v in scalars.items()}
    if "step" in values or "wall_time" in values:
      raise ValueError("metric names 'step' and 'wall_time' are reserved")
    now = time.time()
    record = {"step": step, "wall_time": round(now, 3), **values}
    line = json.dumps(record) + "\n"
    if self._remote:
      self._lines.append(line)
    else:
      self._jsonl.write(line)
    if self._tb is not None:
      for name, v in values.items():
        self._tb.add_scalar(name, float(v), global_step=step, walltime=now)

  def flush(self) -> None:
    """Makes every record written so far visible (remote: uploads the whole file)."""
    if not self.enabled:
      return
    if self._remote:
      epath.Path(self.jsonl_path).write_text("".join(self._lines))
    else:
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if not self.enabled:
      return
    if self._remote:
      self.flush()
    else:
      self._jsonl.close()
    self._jsonl = self._lines = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    self.enabled = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _drop_partial_line(path: str) -> None:
  """Cut a last line without its newline (a process killed mid-write) so appends stay valid."""
  f = epath.Path(path)
  if not f.exists():
    return
  data = f.read_bytes()
  if data and not data.endswith(b"\n"):
    _replace(f, data[:data.rfind(b"\n") + 1])


def _drop_steps_after(path: str, step: int) -> None:
  f = epath.Path(path)
  if not f.exists():
    return
  lines = f.read_text().splitlines(keepends=True)
  kept = [line for line in lines if not line.strip() or json.loads(line)["step"] <= step]
  if len(kept) < len(lines):
    _replace(f, "".join(kept).encode("utf-8"))


def _replace(f: epath.Path, data: bytes) -> None:
  """`f` holding `data`, never half of it (local: rename over; object stores are atomic)."""
  if paths.is_url(f):
    f.write_bytes(data)
    return
  tmp = f.with_name(f.name + ".tmp")
  tmp.write_bytes(data)
  tmp.replace(f)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """Every record of a metrics.jsonl file (local path or URL), in order."""
  with paths.path(path).open("r") as f:
    return [json.loads(line) for line in f if line.strip()]


def format_duration(seconds: float) -> str:
  """Compact duration for ETAs: '45s', '3m05s', '2h07m', '3d04h'; '?' if unknown."""
  if seconds is None or not math.isfinite(seconds):
    return "?"
  sign = "-" if seconds < 0 else ""
  s = int(round(abs(seconds)))
  if s < 60:
    return f"{sign}{s}s"
  if s < 3600:
    return f"{sign}{s // 60}m{s % 60:02d}s"
  if s < 86400:
    return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{sign}{s // 86400}d{s % 86400 // 3600:02d}h"


class StepTimer:
  """Throughput and ETA between log points.
    timer = StepTimer(tokens_per_step=B * T, total_steps=cfg.train.steps, start_step=step)
    ...  # after the first (compiling) step: timer.reset(step)
    rates = timer.update(step)   # steps_per_sec, tokens_per_sec, step_time, eta_seconds

  Call it after the step's device work is done, or it measures dispatch."""

  def __init__(self, *, tokens_per_step: int, total_steps: int, start_step: int = 0,
               clock=time.perf_counter):
    self.tokens_per_step = tokens_per_step
    self.total_steps = total_steps
    self._clock = clock
    self.reset(start_step)

  def reset(self, step: int) -> None:
    """Start a new interval at `step` (e.g. to leave compilation out)."""
    self._step, self._time = step, self._clock()

  def update(self, step: int) -> dict[str, float]:
    now = self._clock()
    steps, dt = step - self._step, now - self._time
    self._step, self._time = step, now
    if steps <= 0 or dt <= 0:
      return {}
    sps = steps / dt
    return {"steps_per_sec": sps,
            "tokens_per_sec": sps * self.tokens_per_step,
            "step_time": dt / steps,
            "eta_seconds": max(self.total_steps - step, 0) / sps}

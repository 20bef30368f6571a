"""Profiler traces of chosen train steps: `python -m k3jax.train --profile_steps=N[,M]`.

Steps N..M (1-based, inclusive) go to `<workdir>/profile/`: xplane, Perfetto and
`train_step.hlo.txt` (for `benchmarks/gpu_trace.py`). Step 1 includes the compile."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import jax

from k3jax import paths


def parse_steps(spec: str | None) -> tuple[int, int] | None:
  """"N" or "N,M" -> (N, M); None or "" -> None. ValueError naming the flag otherwise."""
  if not spec:
    return None
  try:
    steps = tuple(int(s) for s in spec.split(","))
  except ValueError:
    steps = ()
  if len(steps) == 1:
    steps = steps * 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"--profile_steps={spec!r}: expected N or N,M with 1 <= N <= M "
                     "(steps counted from 1)")
  return steps


@contextlib.contextmanager
def names_in_cache_key(on: bool) -> Iterator[None]:
  """While `on`, the compilation cache keys programs by op names too (for current scopes)."""
  flag = "jax_compilation_cache_include_metadata_in_key"
  before = getattr(jax.config, flag)
  if on:
    jax.config.update(flag, True)
  try:
    yield
  finally:
    jax.config.update(flag, before)


class StepTrace:
  """Traces steps N..M; hlo_text() is written beside the trace."""

  def __init__(self, steps: tuple[int, int] | None, directory: str,
               hlo_text: Callable[[], str]):
    self.steps, self.directory, self.hlo_text = steps, directory, hlo_text
    self.active = False

  def before(self, step: int) -> None:
    """Call before running `step` (1-based)."""
    if self.steps and step == self.steps[0] and not self.active:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, out) -> bool:
    """Call after dispatching `step` with its outputs; True when the trace was written."""
    if not (self.active and step >= self.steps[1]):
      return False
    jax.block_until_ready(out)
    self.close()
    return True

  def close(self) -> None:
    if not self.active:
      return
    self.active = False
    jax.profiler.stop_trace()
    if jax.process_index() == 0:
      directory = paths.path(self.directory)
      directory.mkdir(parents=True, exist_ok=True)
      (directory / "train_step.hlo.txt").write_text(self.hlo_text())

"""Profiler traces of chosen train steps: `python -m k3jax.train --profile_steps=N[,M]`.

Steps N to M (counted from 1 as the run logs them, inclusive; N alone: that one step) are
traced with the JAX profiler into `<workdir>/profile/`: the xplane files TensorBoard and
xprof open, a Perfetto copy, and the train step's HLO text (`train_step.hlo.txt`), whose op
names `benchmarks/gpu_trace.py <workdir>/profile` maps the kernels to the model's named
scopes with, giving the step's time per component. Step 1 includes the compile: trace a
later one.
"""

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
  """While `on`, the persistent compilation cache keys programs by their op names too.

  JAX's key leaves them out, so a cached program carries the names of the code that
  compiled it first; a profile of it would attribute kernels to scopes since renamed.
  """
  flag = "jax_compilation_cache_include_metadata_in_key"
  before = getattr(jax.config, flag)
  if on:
    jax.config.update(flag, True)
  try:
    yield
  finally:
    jax.config.update(flag, before)


class StepTrace:
  """Starts the JAX profiler before step N runs and stops it after step M has finished.

  hlo_text: returns the traced program's HLO text, written beside the trace (process 0)
  when the trace stops.
  """

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
    if jax.process_index() == 0:   # through epath: the workdir may be a URL (gs://...)
      directory = paths.path(self.directory)
      directory.mkdir(parents=True, exist_ok=True)
      (directory / "train_step.hlo.txt").write_text(self.hlo_text())

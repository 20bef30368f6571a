"""Run a sweep: arms x seeds of one experiment config, each an ordinary `k3jax.train` run.

  python -m k3jax.sweep --sweep=experiments/sweeps/open_questions.py --workdir=/tmp/oq
  python -m k3jax.report --workdir=/tmp/oq

Runs are subprocesses in DIR/<arm>/seed<N> (format: sweep_spec.py; docs/sweeps.md); a rerun
skips finished ones and resumes the rest."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from absl import app, flags

from k3jax import cli, metrics, paths
from k3jax import config as k3config
from k3jax.sweep_spec import (LOG_NAME, Run, Sweep, finished, last_step, load_sweep,
                              mark_finished, plan, write_record)


def visible_gpus() -> list[str]:
  """The GPU ids this host's runs may use."""
  if os.environ.get("JAX_PLATFORMS", "") not in ("", "cuda", "gpu"):
    return []
  if "CUDA_VISIBLE_DEVICES" in os.environ:
    return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  except OSError:
    return []
  return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def device_slots(parallel: int) -> list[dict]:
  """Per slot, the environment: its share of the GPUs, if any."""
  if parallel < 1:
    raise k3config.ConfigError(f"--parallel must be >= 1, got {parallel}")
  if parallel == 1:
    return [{}]
  gpus = visible_gpus()
  if gpus:
    if parallel > len(gpus):
      raise k3config.ConfigError(f"--parallel={parallel}: this host has {len(gpus)} GPUs")
    per = len(gpus) // parallel
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}
            for i in range(parallel)]
  if os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
    raise k3config.ConfigError("--parallel: one process holds all of a TPU host's chips; "
                               "run one at a time, or --print_commands for a slice each")
  return [{}] * parallel


def run_env(slot: dict, cache_dir: str | None) -> dict:
  """A run's environment: its slot's devices and a compilation cache shared by the sweep."""
  env = {**os.environ, **slot, "PYTHONUNBUFFERED": "1"}
  if cache_dir:
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
  return env


class Runner:
  """Runs one run per slot at a time; SIGTERM is passed on to the runs."""

  def __init__(self, slots: list[dict], record: dict, sweep_dir: str, log=print):
    self.slots, self.log = slots, log
    trains = {arm: a["config"]["train"] for arm, a in record["arms"].items()}
    self.steps = {arm: t["steps"] for arm, t in trains.items()}
    self.cache = {arm: t["compilation_cache"] for arm, t in trains.items()}
    self.cache_dir = os.path.join(os.path.abspath(sweep_dir), "compilation_cache")
    self.running: dict[int, tuple] = {}   # slot -> (run, process, log file, start time)
    self.failed: list[Run] = []
    self.signalled = None

  def _stop(self, signum, frame):
    del frame
    self.signalled = signum
    for _, proc, _, _ in self.running.values():
      proc.send_signal(signum)

  def run(self, runs: list[Run]):
    pending = list(runs)
    previous = signal.signal(signal.SIGTERM, self._stop)
    try:
      while self.running or (pending and self.signalled is None):
        for i, slot in enumerate(self.slots):
          if i not in self.running and pending and self.signalled is None:
            self._start(i, slot, pending.pop(0))
        time.sleep(0.2)
        for i in [i for i, (_, proc, _, _) in self.running.items() if proc.poll() is not None]:
          self._finish(*self.running.pop(i))
    finally:
      signal.signal(signal.SIGTERM, previous)
      for _, proc, _, _ in self.running.values():
        proc.wait()
    if self.signalled is not None:
      self.log("sweep: stopped by a signal; rerun the same command to continue")
      sys.exit(128 + self.signalled)

  def _start(self, i: int, slot: dict, run: Run):
    os.makedirs(run.workdir, exist_ok=True)
    log = os.path.join(run.workdir, LOG_NAME)
    self.log(f"{run.name}: starting" + (" again (it resumes from its checkpoint)"
                                        if os.path.exists(log) else "") + f"; log {log}")
    logfile = open(log, "a")  # noqa: SIM115
    logfile.write(f"=== sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: python -m k3jax.train "
                  f"{shlex.join(run.args)}\n")
    logfile.flush()
    env = run_env(slot, self.cache_dir if self.cache[run.arm] else None)
    proc = subprocess.Popen([sys.executable, "-m", "k3jax.train", *run.args], env=env,
                            stdout=logfile, stderr=subprocess.STDOUT)
    self.running[i] = (run, proc, logfile, time.time())

  def _finish(self, run: Run, proc, logfile, t0: float):
    logfile.close()
    took = metrics.format_duration(time.time() - t0)
    step, steps = last_step(run), self.steps[run.arm]
    if proc.returncode == 0 and step >= steps:
      mark_finished(run)
      self.log(f"{run.name}: done in {took}")
      return
    if self.signalled is None:
      self.failed.append(run)
    if proc.returncode == 0:
      self.log(f"{run.name}: stopped at step {step} of {steps} after {took}")
    else:
      self.log(f"{run.name}: exit {proc.returncode} after {took}: {last_line(run)}")


def last_line(run: Run) -> str:
  """The last line of `run`'s log (a failure's message)."""
  with open(os.path.join(run.workdir, LOG_NAME)) as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[-1] if lines else "(no output)"


def print_commands(runs: list[Run], sweep: Sweep):
  print(f"# {len(runs)} runs of {sweep.spec}, one k3jax.train command each. On a cluster "
        "hand the flags after 'python -m k3jax.train' to launch/slurm_gpu.sbatch, or to "
        "launch/tpu_pod.sh after '--'.")
  for run in runs:
    print(shlex.join(["python", "-m", "k3jax.train", *run.args]))


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    if paths.is_url(f.workdir):
      raise k3config.ConfigError(f"--workdir={f.workdir}: a sweep needs a local directory "
                                 "(a bucket mounted with gcsfuse is one)")
    slots = None if f.print_commands else device_slots(f.parallel)
    sweep = load_sweep(f.sweep)
    runs = plan(sweep, f.workdir)
    record = write_record(sweep, runs, f.workdir)
  except k3config.ConfigError as e:
    cli.fail(str(e))
  todo = [r for r in runs if not finished(r)]
  if f.print_commands:
    print_commands(todo, sweep)
    return
  print(f"sweep: {len(sweep.arms)} arms x {len(sweep.seeds)} seeds in {f.workdir}; "
        f"{len(runs) - len(todo)} finished before, {len(todo)} to run, {len(slots)} at a time",
        flush=True)
  runner = Runner(slots, record, f.workdir, log=lambda msg: print(msg, flush=True))
  try:
    runner.run(todo)
  except KeyboardInterrupt:
    sys.exit("sweep: interrupted; rerun the same command to continue")
  if runner.failed:
    sys.exit(f"sweep: {len(runner.failed)} runs failed: "
             f"{', '.join(r.name for r in runner.failed)} (their train.log says why); rerun "
             "the same command to retry them")
  print(f"sweep: all {len(runs)} runs finished; python -m k3jax.report --workdir={f.workdir}")


if __name__ == "__main__":
  flags.DEFINE_string("sweep", None, "The sweep file, path[:arg] (experiments/sweeps/).")
  flags.DEFINE_string("workdir", None, "Runs go to <workdir>/<arm>/seed<N>.")
  flags.DEFINE_integer("parallel", 1, "Runs at a time (GPUs: each its share of them).")
  flags.DEFINE_bool("print_commands", False, "Print each unfinished run's command instead of "
                    "running it (for a cluster's launcher).")
  flags.mark_flags_as_required(["sweep", "workdir"])
  app.run(main)

"""Runs a multi-process JAX program on this machine: N processes x D CPU devices, gloo collectives.

  python -m launch.local --processes=2 --devices_per_process=4 -- \
      --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny_2proc

Everything after `--` goes to `python -m <module>` (default k3jax.train) in every process.
Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES and
JAX_PROCESS_ID, read by `k3jax.parallel.distributed.initialize`, and D simulated CPU devices.
Cross-process collectives on CPU use gloo, jax 0.10.2's default
(`jax_cpu_collectives_implementation`); the persistent compilation cache is off (see
`process_env` for why). For testing the multi-host code paths without a
cluster; a real pod uses `launch/tpu_pod.sh`, `launch/gke_jobset.yaml` or
`launch/slurm_gpu.sbatch`.

When one process fails the others are stopped (they would otherwise wait at the next
collective until the coordinator's heartbeat times out); the exit status is the first
failure's.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(base: dict, *, port: int, processes: int, process_id: int,
                devices_per_process: int) -> dict:
  """The environment of process `process_id`."""
  env = dict(base)
  # A device count inherited from the caller (e.g. pytest's 8) would override ours.
  xla_flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                     env.get("XLA_FLAGS", "")).split()
  env.update(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=" ".join(xla_flags + [
          f"--xla_force_host_platform_device_count={devices_per_process}"]),
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES=str(processes),
      JAX_PROCESS_ID=str(process_id),
      # On CPU the persistent compilation cache key holds each process' own topology, and
      # only process 0 writes: process 0 would load a program that the others compile anew,
      # and a first collective reached > 30 s apart fails gloo's context setup
      # ("GetKeyValue() timed out with key: cpu:gloo/...").
      JAX_ENABLE_COMPILATION_CACHE="false",
  )
  return env


def launch(args: list[str], *, processes: int, devices_per_process: int,
           module: str = "k3jax.train", env: dict | None = None) -> int:
  """Runs `python -m module *args` as `processes` processes; the first non-zero exit status
  (0 if all succeed). A SIGTERM to this launcher goes to every process (a preemption)."""
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"need processes >= 1 and devices_per_process >= 1, got {processes} and "
                     f"{devices_per_process}")
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", module, *args],
                            env=process_env(os.environ if env is None else env, port=port,
                                            processes=processes, process_id=i,
                                            devices_per_process=devices_per_process))
           for i in range(processes)]

  def forward(signum, frame):
    del frame
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = (signal.signal(signal.SIGTERM, forward)
              if threading.current_thread() is threading.main_thread() else None)
  try:
    failed = _wait(procs)
  except KeyboardInterrupt:
    _stop(procs)
    return 130
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  if failed is None:
    return 0
  _stop(procs)
  print(f"launch.local: process {failed} exited with status {procs[failed].returncode}; "
        "stopped the others", file=sys.stderr, flush=True)
  return procs[failed].returncode


def _wait(procs: list[subprocess.Popen]) -> int | None:
  """Waits until all exit or one fails; the index of the first failure (or None)."""
  while True:
    codes = [p.poll() for p in procs]
    failed = next((i for i, c in enumerate(codes) if c), None)
    if failed is not None or all(c is not None for c in codes):
      return failed
    time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace: float = 10.0):
  """SIGTERM to those still running, SIGKILL after `grace` seconds."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.time() + grace
  for p in procs:
    try:
      p.wait(max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def main(argv: list[str]) -> int:
  own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
      argv, [])
  parser = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=2, help="JAX processes to start")
  parser.add_argument("--devices_per_process", type=int, default=4,
                      help="simulated CPU devices in each process")
  parser.add_argument("--module", default="k3jax.train",
                      help="what each process runs: python -m MODULE ARGS (ARGS: after --)")
  a = parser.parse_args(own)
  return launch(rest, processes=a.processes, devices_per_process=a.devices_per_process,
                module=a.module)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

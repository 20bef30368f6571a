"""The multi-controller runtime: one JAX process per host (or per GPU), one program over all.

`initialize()` starts `jax.distributed` before any device is touched, from the flags
--coordinator_address, --num_processes, --process_id, --local_device_ids (or JAX_*
variables), then JAX's cluster detection; else a single process."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

# name -> (flag, environment variable), for error messages and the environment fallback.
SOURCES = {
    "coordinator_address": ("--coordinator_address", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("--num_processes", "JAX_NUM_PROCESSES"),
    "process_id": ("--process_id", "JAX_PROCESS_ID"),
    "local_device_ids": ("--local_device_ids", "JAX_LOCAL_DEVICE_IDS"),
}
REQUIRED = ("coordinator_address", "num_processes", "process_id")


def detect_cluster() -> str | None:
  """The cluster environment JAX would detect, or None."""
  # JAX keeps its registry private; opt-in methods (mpi4py) are only used when named.
  from jax._src import clusters  # noqa: PLC0415
  for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001
    if not env.opt_in_only_method and env.is_env_present():
      return env.name or env.__name__
  return None


def _from_env(name: str, value):
  if value is not None:
    return value
  var = SOURCES[name][1]
  raw = os.environ.get(var, "").strip()
  if not raw or name == "coordinator_address":
    return raw or None
  try:
    return [int(x) for x in raw.split(",")] if name == "local_device_ids" else int(raw)
  except ValueError:
    what = "a comma-separated list of integers" if name == "local_device_ids" else "an integer"
    raise ValueError(f"{var}={raw!r} is not {what}") from None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None,
            local_device_ids: Sequence[int | str] | None = None) -> dict | None:
  """`jax.distributed.initialize` arguments, or None; ValueError naming gaps."""
  if local_device_ids is not None:
    try:
      local_device_ids = [int(x) for x in local_device_ids]
    except ValueError:
      raise ValueError(f"--local_device_ids: {list(local_device_ids)} are not all "
                       "integers") from None
  values = {
      "coordinator_address": coordinator_address or None,
      "num_processes": num_processes,
      "process_id": process_id,
      "local_device_ids": local_device_ids,
  }
  values = {k: _from_env(k, v) for k, v in values.items()}
  cluster = detect_cluster()
  if cluster is None:
    given = [k for k, v in values.items() if v is not None]
    if not given:
      return None
    missing = [k for k in REQUIRED if values[k] is None]
    if missing:
      named = ", ".join(f"{k} ({' or '.join(SOURCES[k])})" for k in missing)
      raise ValueError(f"multi-process run: {', '.join(given)} given, but {named} missing, "
                       "and no cluster (TPU VM, GKE, SLURM, Open MPI, Kubernetes) was "
                       "detected to supply it")
  n, i = values["num_processes"], values["process_id"]
  if n is not None and n < 1:
    raise ValueError(f"num_processes must be >= 1, got {n}")
  if n is not None and i is not None and not 0 <= i < n:
    raise ValueError(f"process_id must be in [0, num_processes={n}), got {i}")
  if cluster is None and n == 1:
    return None
  return {**values, "cluster": cluster}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: Sequence[int | str] | None = None) -> bool:
  """Starts the runtime if this is one of several processes; returns whether it did."""
  args = resolve(coordinator_address, num_processes, process_id, local_device_ids)
  if args is None:
    return False
  cluster = args.pop("cluster")
  jax.distributed.initialize(**args)
  if jax.process_index() == 0:
    where = args["coordinator_address"] or f"detected ({cluster})"
    print(f"distributed: {jax.process_count()} processes, coordinator {where}", flush=True)
  return True

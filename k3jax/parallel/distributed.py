"""The multi-controller runtime: one JAX process per host (or per GPU), one program over all.

`initialize()` calls `jax.distributed.initialize` when the run spans several processes and
does nothing for a single process. It must run before anything touches a JAX device. The
values come from, first match wins:

  1. explicit values: the `k3jax.train` flags --coordinator_address, --num_processes,
     --process_id, --local_device_ids, else the environment variables JAX_COORDINATOR_ADDRESS,
     JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS (what `launch/local.py` sets);
  2. JAX's own cluster detection (jax 0.10.2, `jax._src.clusters`) fills whatever is unset:
       gcetpu  Cloud TPU VMs and queued resources (GCE metadata; multislice via MEGASCALE_*)
       gketpu  TPU pods on GKE, e.g. a JobSet (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID)
       slurm   inside `srun` (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
               SLURM_LOCALID); one process per task, a task sees GPU SLURM_LOCALID unless
               local_device_ids says otherwise
       ompi    inside `mpirun` of Open MPI (OMPI_MCA_orte_hnp_uri)
       K8sCluster  an indexed Kubernetes Job or JobSet (KUBERNETES_SERVICE_HOST; needs the
               `kubernetes` package: `pip install "jax[k8s]"`)
  3. neither: a single process.

Without a detected cluster, coordinator_address, num_processes and process_id go together:
giving some but not all is an error naming the missing ones.
"""

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
  """The cluster environment that JAX's auto-detection would use ('gcetpu', 'gketpu',
  'slurm', 'ompi', 'K8sCluster'), or None outside of any."""
  # JAX keeps its registry private; opt-in methods (mpi4py) are only used when named.
  from jax._src import clusters  # noqa: PLC0415
  for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001
    if not env.opt_in_only_method and env.is_env_present():
      return env.name or env.__name__
  return None


def _from_env(name: str, value):
  """`value`, or else the environment variable for `name`, parsed; None when neither is set."""
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
  """The explicit arguments (or their environment variables) for `jax.distributed.initialize`,
  or None for a single process. ValueError naming what is missing when only some are given
  and no cluster is detected to supply the rest."""
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
  """Starts the multi-controller runtime if this is one of several processes (see the module
  docstring for where the values come from); returns whether it did. Call it first, before
  any JAX computation."""
  args = resolve(coordinator_address, num_processes, process_id, local_device_ids)
  if args is None:
    return False
  cluster = args.pop("cluster")
  jax.distributed.initialize(**args)
  if jax.process_index() == 0:  # logs come from process 0 only, like k3jax.train's
    where = args["coordinator_address"] or f"detected ({cluster})"
    print(f"distributed: {jax.process_count()} processes, coordinator {where}", flush=True)
  return True

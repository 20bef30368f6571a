"""Multi-controller training: 2 processes x 4 CPU devices (launch.local, jax.distributed over
gloo) train exactly as 1 process x 8 devices on the same mesh and global batches, and a
checkpoint saved by 2 processes resumes under 2 processes and under 1."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from multiprocess_worker import mp_config

from k3jax import train as k3train
from k3jax.parallel import distributed
from launch import local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_processes(workdir: str, stop_after: int):
  """mp_config trained in `workdir` for `stop_after` steps by 2 processes x 4 devices."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
  run = subprocess.run(
      [sys.executable, "-m", "launch.local", "--processes=2", "--devices_per_process=4",
       "--module=multiprocess_worker", "--", workdir, str(stop_after)],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
  assert "distributed: 2 processes" in run.stdout, run.stdout[-3000:]
  return run.stdout


def metrics(workdir: str, key: str) -> dict[int, float]:
  """{step: value} of `key` in the run's metrics.jsonl; each step written once (process 0)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  steps = [r["step"] for r in rows if key in r]
  assert len(steps) == len(set(steps)), f"{key} written more than once per step: {steps}"
  return {r["step"]: r[key] for r in rows if key in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """two: 2 processes, steps 1-2 then (resumed) 3-4; one: 1 process, steps 1-4;
  one_resumed: 1 process, steps 3-4 from the 2-process checkpoint of step 2."""
  base = tmp_path_factory.mktemp("mp")
  two, one, one_resumed = (str(base / n) for n in ("two", "one", "one_resumed"))
  out = two_processes(two, stop_after=2)
  assert "8 device(s)" in out and "4 rows on this process" in out, out[-3000:]
  assert out.count("k3jax: jax") == 1, out[-3000:]  # only process 0 logs
  shutil.copytree(two, one_resumed)
  two_processes(two, stop_after=2)
  k3train.train(mp_config(), one)
  k3train.train(mp_config(), one_resumed)
  return two, one, one_resumed


@pytest.mark.slow
def test_two_processes_train_as_one(runs):
  # 2 processes (stopped and resumed at step 2) against 1 process straight through. fp32
  # throughout, so only the order of cross-device sums differs (gloo adds across processes
  # in its own order): the losses agree to ~1e-7 (measured); a batch row fed twice, a
  # mis-placed shard or a wrongly restored one would show far above 1e-6.
  two, one, _ = runs
  got, want = metrics(two, "loss"), metrics(one, "loss")
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)],
                             rtol=1e-6)


@pytest.mark.slow
def test_two_process_checkpoint_resumes_under_two_and_one(runs):
  # Steps 3-4 from the 2-process checkpoint of step 2, by 2 processes and by 1.
  two, _, one_resumed = runs
  got, want = metrics(one_resumed, "loss"), metrics(two, "loss")
  assert sorted(got) == [1, 2, 3, 4]  # 1-2 written by the 2-process run before the copy
  np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-6)
  assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["2", "4"]


# --- k3jax.parallel.distributed and launch.local without a multi-process run ---------------

CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
               "JAX_LOCAL_DEVICE_IDS", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
               "SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri",
               "KUBERNETES_SERVICE_HOST", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES")


@pytest.fixture
def no_cluster(monkeypatch):
  for k in CLUSTER_ENV:
    monkeypatch.delenv(k, raising=False)
  return monkeypatch


def test_single_process_is_a_no_op(no_cluster):
  assert distributed.resolve() is None
  assert distributed.resolve("127.0.0.1:1234", 1, 0) is None
  assert not distributed.initialize()


def test_half_given_values_name_the_missing_ones(no_cluster):
  no_cluster.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
  with pytest.raises(ValueError, match=r"num_processes \(--num_processes or JAX_NUM_PROCESSES"
                     r"\), process_id \(--process_id or JAX_PROCESS_ID\) missing"):
    distributed.resolve()
  with pytest.raises(ValueError, match=r"coordinator_address, num_processes given, but "
                     r"process_id"):
    distributed.resolve(num_processes=2)
  with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes=2\)"):
    distributed.resolve(num_processes=2, process_id=2)
  no_cluster.setenv("JAX_PROCESS_ID", "one")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
    distributed.resolve(num_processes=2)


def test_flags_and_environment(no_cluster):
  no_cluster.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  no_cluster.setenv("JAX_NUM_PROCESSES", "4")
  no_cluster.setenv("JAX_PROCESS_ID", "3")
  no_cluster.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")
  assert distributed.resolve(process_id=2) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2,
      "local_device_ids": [0, 1], "cluster": None}


def test_slurm_is_detected_and_jax_fills_in_the_rest(no_cluster):
  # What launch/slurm_gpu.sbatch relies on: task 5 of 16 on the second of two nodes.
  from jax._src import clusters  # noqa: PLC0415
  for k, v in dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="gpu[007-008]", SLURM_NTASKS="16",
                   SLURM_PROCID="13", SLURM_LOCALID="5").items():
    no_cluster.setenv(k, v)
  got = distributed.resolve()
  assert got["cluster"] == "slurm" and got["num_processes"] is None
  assert clusters.ClusterEnv.auto_detect_unset_distributed_params(
      None, None, None, None, None, 300) == (f"gpu007:{4242 % 4096 + 61440}", 16, 13, [5])


def test_launcher_stops_the_others_when_one_fails(tmp_path):
  (tmp_path / "fails_on_1.py").write_text(
      "import os, sys, time\n"
      "if os.environ['JAX_PROCESS_ID'] == '1':\n  sys.exit(3)\n"
      "time.sleep(600)\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  t0 = time.time()
  assert local.launch([], processes=2, devices_per_process=1, module="fails_on_1", env=env) == 3
  assert time.time() - t0 < 60

"""Fault handling, end to end: a non-finite step is skipped and counted, too many in a row
stop the run, SIGTERM saves and exits, a damaged newest checkpoint gives way to the previous
one, an incompatible config or an unwritable workdir is refused, and a run killed with
SIGKILL again and again (once mid-save) ends bit for bit where an uninterrupted one does."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import TRAIN_PROGRAM, train_config

from k3jax import checkpoint as k3ckpt
from k3jax import config as k3config
from k3jax import metrics as k3metrics
from k3jax import train as k3train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import fault_injection  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
CACHE = jax.config.jax_compilation_cache_dir  # conftest's persistent cache, shared with children


# --- non-finite steps ---------------------------------------------------------------------

class _Poisoned:
  """The train dataset with NaN loss weights in the batches of the given steps (1-based,
  counted from the start of this process)."""

  def __init__(self, ds, steps):
    self.ds, self.steps = ds, steps

  def __iter__(self):
    return _PoisonedIter(iter(self.ds), self.steps)


class _PoisonedIter:

  def __init__(self, it, steps):
    self.it, self.steps, self.n = it, steps, 0

  def __next__(self):
    batch, self.n = next(self.it), self.n + 1
    if self.n in self.steps:
      batch = {**batch, "weights": batch["weights"] * np.float32(np.nan)}
    return batch

  def get_state(self):
    return self.it.get_state()

  def set_state(self, state):
    self.it.set_state(state)


def _poison(monkeypatch, steps):
  make = k3train.k3data.make_dataset

  def make_poisoned(*args, split="train", **kwargs):
    ds = make(*args, split=split, **kwargs)
    return _Poisoned(ds, steps) if split == "train" else ds

  monkeypatch.setattr(k3train.k3data, "make_dataset", make_poisoned)


def _metrics(workdir):
  return fault_injection.metrics_by_step(workdir)


@TRAIN_PROGRAM
def test_nan_batch_is_skipped_and_counted(tmp_path, monkeypatch):
  c = train_config()
  c.train.checkpoint_every, c.train.keep_checkpoints, c.train.eval_every = 2, 0, 0
  _poison(monkeypatch, {3})
  params, rest = k3train.train(c, str(tmp_path / "stopped"), stop_after=3)
  k3train.train(c, str(tmp_path), stop_after=4)
  m = _metrics(tmp_path)
  assert [m[s]["skipped"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]   # a running total
  assert np.isnan(m[3]["loss"]) and np.isfinite(m[4]["loss"])
  assert k3ckpt.Checkpointer(tmp_path).all_steps() == [2, 4]
  states = {s: fault_injection.load_state(tmp_path, s) for s in (2, 4)}
  # the skipped step 3 changed nothing: the run stopped after it returns step 2's state
  after_skip = {re.sub(r"\[(\d+)\]", r"['\1']", jax.tree_util.keystr(p)[3:]): np.asarray(x)
                for p, x in jax.tree_util.tree_flatten_with_path((params, rest))[0]}
  saved = {re.sub(r"\[(\d+)\]", r"['\1']", k[3:]): v for k, v in states[2].items()
           if k.startswith(("[0]", "[1]"))}   # checkpoints store list indices as strings
  assert after_skip, "no arrays"
  assert sorted(after_skip) == sorted(saved)
  for k, x in after_skip.items():   # params and Quantile-Balancing biases: untouched
    assert x.tobytes() == saved[k].tobytes(), k
  changed = {k for k in states[2] if states[2][k].tobytes() != states[4][k].tobytes()}
  assert any(k.startswith("[0]") for k in changed)   # the next good step updates again:
  assert any(k.startswith("[1]") for k in changed)   # params and Quantile-Balancing biases
  with open(tmp_path / "checkpoints" / "4" / "progress" / "metadata") as f:
    assert json.load(f) == {"skipped": 1, "bad_run": 0}


@TRAIN_PROGRAM
def test_a_divergence_stops_without_checkpoints_and_resumes_past_its_batches(tmp_path,
                                                                              monkeypatch):
  """Steps 3-5 diverge: nothing is saved during them (so rotation keeps step 2), the stop
  names step 2 and how to skip the batches; the rerun that does so trains on from step 2
  with finite losses, each step logged once."""
  c = train_config()
  c.train.checkpoint_every, c.train.keep_checkpoints, c.train.eval_every = 1, 1, 0
  c.train.max_bad_steps, c.train.log_every = 3, 1
  _poison(monkeypatch, {3, 4, 5})
  with pytest.raises(FloatingPointError, match=r"step 5: 3 steps in a row .*max_bad_steps=3.*"
                     r"The last checkpoint, written before them, is step 2 in .*checkpoints.*"
                     r"--config.train.skip_batches=2:3 to also skip the batches of steps 3-5"):
    k3train.train(c, str(tmp_path))
  assert k3ckpt.Checkpointer(tmp_path).all_steps() == [2]
  monkeypatch.undo()   # the data as it is: the poisoned batches are among the skipped
  c.train.skip_batches = "2:3"
  k3train.train(c, str(tmp_path), stop_after=2)
  steps = [r["step"] for r in k3metrics.read_jsonl(tmp_path / "metrics.jsonl")]
  assert steps == [1, 2, 3, 4], steps
  m = _metrics(tmp_path)
  assert np.isfinite([m[3]["loss"], m[4]["loss"]]).all() and m[4]["skipped"] == 0
  # the data of steps 3 and 4 is what an uninterrupted run reads at steps 6 and 7
  assert k3ckpt.Checkpointer(tmp_path).all_steps() == [4]


def test_skip_batches_is_validated():
  c = train_config()
  c.train.skip_batches = "3"
  with pytest.raises(k3config.ConfigError, match="train.skip_batches.*'S:K'"):
    k3config.validate(c)


def test_max_bad_steps_is_validated():
  c = train_config()
  c.train.max_bad_steps = 0
  with pytest.raises(k3config.ConfigError, match="train.max_bad_steps"):
    k3config.validate(c)


# --- checkpoints: damage, config, workdir -----------------------------------------------

def _save_steps(directory, steps=(1, 2, 3)):
  cfg = k3config.base_config().to_json()
  with k3ckpt.Checkpointer(directory, keep=0) as ckpt:
    for s in steps:
      ckpt.save(s, {"w": jnp.arange(64.0) * s, "b": jnp.full((3,), s, jnp.int32)},
                {"next": s}, cfg, progress={"skipped": s}, force=True)


def _target():
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=sh),
          "b": jax.ShapeDtypeStruct((3,), jnp.int32, sharding=sh)}


def _truncate_array_file(step_dir):
  # state/d/: the data files of the OCDBT database the processes' writes are merged into
  files = list((step_dir / "state" / "d").iterdir())
  os.truncate(max(files, key=os.path.getsize), 10)


DAMAGE = {
    "truncated array file": _truncate_array_file,
    "commit marker deleted": lambda d: os.remove(d / k3ckpt.COMMIT_MARKER),
    "state metadata deleted": lambda d: os.remove(d / "state" / "_METADATA"),
    "state metadata garbled": lambda d: (d / "state" / "_METADATA").write_text('{"tree": [gar'),
    "config garbled": lambda d: (d / "config" / "metadata").write_text("\x00\x01not json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_falls_back(tmp_path, damage, caplog):
  _save_steps(tmp_path)
  root = tmp_path / "checkpoints"
  DAMAGE[damage](root / "3")
  with k3ckpt.Checkpointer(tmp_path) as ckpt:
    got = ckpt.restore_latest(_target(), config_json=k3config.base_config().to_json(),
                              must_match=k3config.RESTORE_FIELDS)
    assert got.step == 2 and got.data == {"next": 2} and got.progress == {"skipped": 2}
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(64.0) * 2)
    assert ckpt.all_steps() == [1, 2]
  assert "step 3 (" in caplog.text and "restored step 2" in caplog.text, caplog.text
  assert (root / "3.corrupt").is_dir()   # kept for inspection, out of orbax's view
  with k3ckpt.Checkpointer(tmp_path) as ckpt:   # saving step 3 again works
    ckpt.save(3, {"w": jnp.zeros(64), "b": jnp.zeros(3, jnp.int32)}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]


def test_no_readable_checkpoint_is_an_error(tmp_path):
  _save_steps(tmp_path, steps=(1,))
  os.remove(tmp_path / "checkpoints" / "1" / k3ckpt.COMMIT_MARKER)
  for _ in range(2):   # the second time, from the moved-aside directory alone
    with k3ckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError,
                                                              match="no readable checkpoint"):
      ckpt.restore_latest(_target())


def test_incompatible_config_names_the_field(tmp_path):
  _save_steps(tmp_path)
  c = k3config.base_config()
  c.model.d_model, c.optimizer.name = 64, "adamw"
  with k3ckpt.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(k3ckpt.IncompatibleCheckpoint,
                       match=r"config.model.d_model: 7168 in the checkpoint .*, 64 now\n"
                             r"  config.optimizer.name: 'muon' in the checkpoint .*'adamw' now"):
      ckpt.restore_latest(_target(), config_json=c.to_json(), must_match=k3config.RESTORE_FIELDS)
    c = k3config.base_config()
    c.model.dtype, c.model.remat, c.optimizer.learning_rate = "float32", "none", 1.0
    got = ckpt.restore_latest(_target(), config_json=c.to_json(),
                              must_match=k3config.RESTORE_FIELDS)
    assert got.step == 3   # compute dtype, remat, learning rate may change


def test_unwritable_or_full_workdir_is_refused_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  t0 = time.time()
  with pytest.raises(OSError, match="a_file/run/checkpoints.*not writable"):
    k3train.train(train_config(), str(blocker / "run"))
  assert time.time() - t0 < 10   # before any model is built or compiled
  with pytest.raises(OSError, match="GiB free; a checkpoint needs"):
    k3ckpt.check_free_space(tmp_path, 1 << 62)


def test_a_resumed_run_drops_the_metrics_logged_past_its_checkpoint(tmp_path):
  lines = "".join(f'{{"step": {s}, "loss": {s}.0}}\n' for s in (1, 2, 3, 4))
  (tmp_path / "metrics.jsonl").write_text(lines + '{"step": 2, "eval_loss": 1.0}\n')
  with k3metrics.MetricWriter(tmp_path, tensorboard=False, resume_step=2) as writer:
    writer.write_scalars(3, {"loss": 0.5})
  rows = k3metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r.get("loss")) for r in rows] == [(1, 1.0), (2, 2.0), (2, None),
                                                        (3, 0.5)]


def test_metrics_line_cut_by_a_kill_is_dropped(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  with k3metrics.MetricWriter(tmp_path, tensorboard=False) as writer:
    writer.write_scalars(2, {"loss": 1.5})
  rows = k3metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.0), (2, 1.5)]


# --- processes: SIGTERM and SIGKILL ------------------------------------------------------

TRAIN_CONFIG = '''"""test_train.train_config() for training subprocesses (importing test_train
would import k3jax.train twice and define its flags twice)."""
import sys
sys.path.insert(0, {tests!r})
import jax
from conftest import micro_config

# conftest caches programs that compile in over 1 s; a restart should compile nothing, and
# every save slices each array shape once (a few hundred small programs on 8 devices).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def get_config(arg=None):
  del arg
  c = micro_config()
  c.model.vocab_size = 384
  c.train.steps, c.train.global_batch = 12, 8
  c.train.checkpoint_every, c.train.eval_every = 4, 6
  return c
'''


@pytest.fixture
def micro(tmp_path):
  """(config path, subprocess environment): test_train's config on the same 8 simulated
  devices, so its programs are in the persistent compilation cache already (compiling them
  takes minutes on 2 cores) and no process start compiles."""
  path = tmp_path / "micro.py"
  path.write_text(TRAIN_CONFIG.format(tests=TESTS))
  spec = importlib.util.spec_from_file_location("subprocess_config", path)
  module = importlib.util.module_from_spec(spec)
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  spec.loader.exec_module(module)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
  assert module.get_config().to_json() == train_config().to_json()
  env = fault_injection.subprocess_env(CACHE)
  env["K3JAX_TEST_CACHE"] = CACHE   # conftest, imported by the config, sets the cache too
  return str(path), env


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, micro):
  config, env = micro
  workdir = str(tmp_path / "run")
  # The kill test's programs (train.steps is in the schedule); no checkpoint before step 12.
  cmd = fault_injection.train_command(config, workdir, ["--config.train.checkpoint_every=100"])
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=fault_injection.REPO)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step      3/"):
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out[-3000:]
  saved = int(out.split("preempted: saved step ")[1].split(";")[0])
  assert 3 <= saved < 12 and max(_metrics(workdir)) == saved, out[-2000:]
  assert fault_injection.load_state(workdir, saved)   # committed, readable


def test_sigterm_during_the_first_compile_exits_within_seconds(tmp_path, micro):
  """Nothing new to save before the first step runs: the process ends at once, not after
  the compile (minutes) and a step. A new weight decay makes the step a new program (a new
  learning rate would not: the schedule's numbers are optimizer state)."""
  config, env = micro
  cmd = fault_injection.train_command(config, str(tmp_path / "run"),
                                      ["--config.optimizer.weight_decay=0.0123"])
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=fault_injection.REPO)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("train: steps 0 -> 12"):   # printed as the first step starts
      break
  time.sleep(2.0)
  sent = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out = "".join(lines) + proc.communicate(timeout=60)[0]
  waited = time.monotonic() - sent
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  assert "SIGTERM before the first step of this run: nothing new to save" in out
  assert waited < 5.0, waited
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "1")


CTRL_C = """
import os, signal, time
from k3jax.train import Preemption
p = Preemption()
os.kill(os.getpid(), signal.SIGINT)     # during a step: noted, the step goes on
time.sleep(0.5)
p.arm()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.5)
print("stop after this step:", p.signalled, flush=True)
os.kill(os.getpid(), signal.SIGINT)     # again: out at once
time.sleep(5)
print("still running")
"""


def test_ctrl_c_stops_after_the_step_and_twice_at_once():
  """Ctrl-C is a user's SIGTERM: before the first step it exits at once; during training the
  first stops the run after the current step (its checkpoint saved), a second exits
  without saving; short messages, no traceback."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  before = subprocess.run([sys.executable, "-c", CTRL_C.replace("p.arm()", "")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=fault_injection.REPO)
  assert before.returncode == 128 + signal.SIGINT, before.stderr[-2000:]
  assert "Ctrl-C before the first step of this run: nothing new to save" in before.stderr
  run = subprocess.run([sys.executable, "-c", CTRL_C.replace(
      "os.kill(os.getpid(), signal.SIGINT)     # during a step: noted, the step goes on", "")],
      env=env, capture_output=True, text=True, timeout=60, cwd=fault_injection.REPO)
  assert run.returncode == 128 + signal.SIGINT, run.stderr[-2000:]
  assert "stop after this step: True" in run.stdout and "still running" not in run.stdout
  assert "Ctrl-C: saving after this step" in run.stderr
  assert "Ctrl-C again: exiting without saving" in run.stderr
  assert "Traceback" not in run.stderr + before.stderr


@pytest.mark.slow
def test_kill9_again_and_again_equals_uninterrupted(tmp_path, micro):
  """The headline: 5 SIGKILLs at random steps (one mid-save), the same command rerun each
  time; final state and every logged metric equal an uninterrupted run, bit for bit."""
  config, env = micro
  summary = fault_injection.fault_injection(config, str(tmp_path), steps=12,
                                            checkpoint_every=3, kills=5, seed=0, env=env,
                                            timeout=1800)  # a cold cache compiles for minutes
  print(fault_injection.markdown(summary))
  kills = summary["events"][:-1]
  assert len(kills) == 5 and all(e["killed"] for e in kills)
  assert any(e["during_save"] and e["in_flight"] for e in kills), kills   # killed mid-save
  assert summary["differences"] == []

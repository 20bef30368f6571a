"""The trainer end to end on the micro config: it learns, and a resumed run equals an
uninterrupted one."""

import json
import os
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest
from conftest import micro_config
from flax import nnx

from k3jax import config as k3config
from k3jax import data as k3data
from k3jax import optim, parallel, program, scoring
from k3jax import train as k3train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_trace  # noqa: E402  (benchmarks/ is not a package)


def train_config():
  c = micro_config()
  c.model.vocab_size = 384  # byte tokenizer: 258 ids
  c.train.steps, c.train.global_batch = 12, 8  # one row per simulated device
  c.train.checkpoint_every, c.train.eval_every = 4, 6
  return c


# The train step of train_config compiles for minutes on 2 cores: every test that trains it
# (here and tests/test_fault_tolerance.py) runs in one pytest-xdist worker (--dist loadgroup),
# which builds the program once (k3jax.program.build_once) instead of once per worker.
TRAIN_PROGRAM = pytest.mark.xdist_group("train_program")
pytestmark = TRAIN_PROGRAM


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def with_tasks(c, directory):
  """c scoring a text file and a multiple-choice file at each eval."""
  text, choices = os.path.join(directory, "held.txt"), os.path.join(directory, "mc.jsonl")
  with open(text, "w") as f:
    f.write("The quick brown fox jumps over the lazy dog. " * 3)
  with open(choices, "w") as f:
    for ctx in ("The cat", "A dog", "Some birds"):
      f.write(json.dumps({"context": ctx, "choices": [" sat.", " flew away."], "answer": 1})
              + "\n")
  c.train.eval_text, c.train.eval_choices = text, choices
  return c


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  c = with_tasks(train_config(), str(tmp_path_factory.mktemp("tasks")))
  params, rest = k3train.train(c, workdir)
  return workdir, params, rest, c


def test_loss_falls(uninterrupted):
  workdir, *_ = uninterrupted
  got = losses(workdir)
  assert sorted(got) == list(range(1, 13))
  assert got[12] < got[1] - 0.5, got


def test_resumed_run_equals_uninterrupted(uninterrupted, tmp_path):
  """... and tracing steps 4-5 with the profiler (--profile_steps) changes nothing."""
  workdir, params, rest, _ = uninterrupted
  resumed = str(tmp_path)
  k3train.train(train_config(), resumed, stop_after=5,   # stops at step 5, saved there
                profile_steps=(4, 5))
  assert sorted(losses(resumed)) == list(range(1, 6))
  profiled = os.path.join(resumed, "profile")
  table = "\n".join(gpu_trace.component_table(
      gpu_trace.gpu_kernels(gpu_trace.load(pathlib.Path(profiled))),
      gpu_trace.parse_hlo(open(os.path.join(profiled, "train_step.hlo.txt")).read())))
  for component in ("| kda |", "| mla |", "| attn_res |", "| moe.experts |", "| optimizer |"):
    assert component in table, table
  params2, rest2 = k3train.train(train_config(), resumed)  # the same command again
  got, want = losses(resumed), losses(workdir)
  assert [got[s] for s in range(6, 13)] == [want[s] for s in range(6, 13)]
  for (path, a), (_, b) in zip(nnx.to_flat_state(params2), nnx.to_flat_state(params)):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
  jax.tree.map(np.testing.assert_array_equal, rest2, rest)  # Quantile-Balancing biases


def test_a_longer_run_goes_on_with_the_program_it_has(uninterrupted, tmp_path):
  """The finished 12-step run, rerun with 16 steps and half the peak rate, resumes at step 12
  and trains steps 13-16 on the program already built: the schedule's numbers are optimizer
  state (k3jax.optim.schedule), and the logged rate follows the new schedule."""
  workdir, *_ = uninterrupted
  longer = str(tmp_path / "run")
  shutil.copytree(workdir, longer)
  c = train_config()
  c.train.steps, c.optimizer.learning_rate = 16, c.optimizer.learning_rate / 2
  mesh = parallel.make_mesh(c.mesh)
  built = program.build_once(train_config(), mesh)
  k3train.train(c, longer)
  assert program.build_once(c, mesh) is built
  with open(os.path.join(longer, "metrics.jsonl")) as f:
    rows = {r["step"]: r for r in map(json.loads, f) if "lr" in r}
  assert sorted(rows) == list(range(1, 17))
  schedule = optim.make_schedule(c)
  for step in range(13, 17):
    np.testing.assert_allclose(rows[step]["lr"], float(schedule(step - 1)), rtol=1e-6)
  assert np.isfinite([rows[s]["loss"] for s in range(13, 17)]).all()


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
  c = train_config()
  c.model.vocab_size = 100
  with pytest.raises(k3config.ConfigError, match="vocab_size"):
    k3train.train(c, str(tmp_path))


def test_eval_tasks_are_scored_every_eval_every(uninterrupted):
  """train.eval_text / eval_choices: scored at each eval (steps 6 and 12), the last with the
  numbers k3jax.scoring (what python -m k3jax.eval runs) gives the final parameters."""
  workdir, params, rest, c = uninterrupted
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  evals = {r["step"]: r for r in rows if "eval_text_bits_per_byte" in r}
  assert sorted(evals) == [6, 12]
  assert evals[6]["eval_text_bits_per_byte"] != evals[12]["eval_text_bits_per_byte"]
  prog = program.build_once(c, parallel.make_mesh(c.mesh))
  tok = k3data.make_tokenizer(c.data.tokenizer)
  with prog.rules():
    scorer = scoring.Scorer(nnx.merge(prog.graphdef, params, rest), c.train.seq_len + 1, 8)
    want = scoring.as_scalars(scoring.Tasks([c.train.eval_text], [c.train.eval_choices])
                              .run(scorer, tok))
  assert set(want) == {k for k in evals[12] if k.startswith("eval_") and k != "eval_loss"}
  assert "eval_mc_accuracy" in want and "eval_text_perplexity" in want
  for k, v in want.items():
    np.testing.assert_allclose(evals[12][k], v, rtol=1e-6, err_msg=k)


def test_missing_eval_task_file_is_refused_before_anything_is_written(tmp_path):
  c = with_tasks(train_config(), str(tmp_path))
  c.train.eval_choices = str(tmp_path / "absent.jsonl")
  workdir = tmp_path / "run"
  with pytest.raises(k3config.ConfigError, match="config.train.eval_choices.*absent.jsonl"):
    k3train.train(c, str(workdir))
  assert not workdir.exists()


def test_a_rerun_loads_its_programs_from_the_workdirs_compilation_cache(tmp_path):
  """`train.compilation_cache` (on by default), in a process with no cache of JAX's own:
  the first run stores its compiled programs under <workdir>/compilation_cache; the same
  run started again (its checkpoints gone) finds every one of them there: it stores
  nothing, each entry keeps its file."""
  import shutil  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=root)
  workdir = tmp_path / "run"

  def run(steps):
    got = subprocess.run(
        [sys.executable, "-m", "k3jax.train", "--config=experiments/k3_tiny.py",
         f"--workdir={workdir}", "--config.model.num_layers=2", "--config.model.mla_every=2",
         "--config.model.dense_layers=0", "--config.model.d_model=64",
         "--config.train.seq_len=32", "--config.train.global_batch=2",
         f"--config.train.steps={steps}", "--config.train.eval_every=0",
         "--config.train.checkpoint_every=1", "--config.optimizer.warmup_steps=0"],
        cwd=root, env=env, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    return got.stderr + got.stdout

  cache = workdir / "compilation_cache"
  assert f"compile: cache in {cache}" in run(1)
  stored = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
  assert stored
  shutil.rmtree(workdir / "checkpoints")
  assert "done: step 1" in run(1)
  assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stored

"""Sweeps: a sweep killed mid-run and rerun finishes every run exactly once, and its report
shows every arm; a sweep file's mistakes are named before anything runs; every arm of
experiments/sweeps/open_questions.py is a valid config with the choice it names."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import matplotlib.image
import pytest

from k3jax import cli, metrics
from k3jax import config as k3config
from k3jax.model.k3 import layer_plan
from k3jax.sweep import device_slots
from k3jax.sweep_spec import DONE_JSON, LOG_NAME, load_sweep, plan, run_config

# the killed-and-resumed sweep (a module fixture) runs once, in one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("sweep")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MICRO = "experiments/sweeps/micro.py"
OPEN_QUESTIONS = "experiments/sweeps/open_questions.py"


def sweep_env() -> dict:
  """One CPU device per run (no simulated 8), the tests' compilation cache for every
  program (each seed of an arm loads what the first compiled)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
             JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,   # conftest's
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return env


def committed_steps(run_dir: pathlib.Path) -> list[int]:
  ckpts = run_dir / "checkpoints"
  return sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) if ckpts.exists() else []


def train_steps(run_dir: pathlib.Path) -> list[int]:
  return [r["step"] for r in metrics.read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """The micro sweep (situ_glu, swiglu x seeds 0, 1; seed-major) SIGKILLed with its process
  group once situ_glu/seed0 has finished and swiglu/seed0 has saved a checkpoint, then rerun
  two at a time. Returns (workdir, the checkpoint swiglu/seed0 resumes from, the rerun's
  output)."""
  workdir = tmp_path_factory.mktemp("sweep")
  cmd = [sys.executable, "-m", "k3jax.sweep", f"--sweep={MICRO}", f"--workdir={workdir}"]
  first, second = workdir / "situ_glu" / "seed0", workdir / "swiglu" / "seed0"
  with open(workdir.parent / "killed.log", "w") as out:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=sweep_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while not ((first / DONE_JSON).exists() and committed_steps(second)):
      assert proc.poll() is None and time.time() < deadline, (
          (workdir.parent / "killed.log").read_text()[-3000:])
      time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  assert not (second / DONE_JSON).exists()
  resume_from = committed_steps(second)[-1]
  assert resume_from < 12, "swiglu/seed0 finished before the kill"
  again = subprocess.run(cmd + ["--parallel=2"], cwd=ROOT, env=sweep_env(),
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  return workdir, resume_from, again.stdout


# The tests that read the killed and resumed sweep run in one pytest-xdist worker, which
# runs it once.
SWEPT = pytest.mark.xdist_group("sweep")


@SWEPT
def test_a_killed_sweep_reruns_only_its_unfinished_runs(resumed):
  workdir, resume_from, output = resumed
  assert "2 arms x 2 seeds" in output and "1 finished before, 3 to run, 2 at a time" in output
  assert "situ_glu/seed0: starting" not in output
  assert "swiglu/seed0: starting again" in output
  for arm in ("situ_glu", "swiglu"):
    for seed in (0, 1):
      run = workdir / arm / f"seed{seed}"
      assert (run / DONE_JSON).exists(), run
      assert train_steps(run) == list(range(1, 13)), run   # each step logged once
      log = (run / LOG_NAME).read_text()
      starts = log.count("=== sweep")
      assert starts == (2 if (arm, seed) == ("swiglu", 0) else 1), (run, starts)
  log = (workdir / "swiglu" / "seed0" / LOG_NAME).read_text()
  assert f"restore: step {resume_from} from" in log   # its own checkpoint, not from scratch
  loss_at_1 = {s: metrics.read_jsonl(workdir / "situ_glu" / f"seed{s}" / "metrics.jsonl")[0]
               ["loss"] for s in (0, 1)}
  assert loss_at_1[0] != loss_at_1[1]   # the seed reached the run


@SWEPT
def test_a_finished_sweep_runs_nothing(resumed):
  workdir = resumed[0]
  logs = {p: p.read_text() for p in workdir.glob(f"*/seed*/{LOG_NAME}")}
  got = subprocess.run([sys.executable, "-m", "k3jax.sweep", f"--sweep={MICRO}",
                        f"--workdir={workdir}"], cwd=ROOT, env=sweep_env(),
                       capture_output=True, text=True, timeout=300)
  assert got.returncode == 0, got.stderr[-3000:]
  assert "4 finished before, 0 to run" in got.stdout
  assert logs == {p: p.read_text() for p in workdir.glob(f"*/seed*/{LOG_NAME}")}


@SWEPT
def test_the_report_has_a_row_per_arm_and_figures_that_decode(resumed):
  workdir = resumed[0]
  got = subprocess.run([sys.executable, "-m", "k3jax.report", f"--workdir={workdir}"],
                       cwd=ROOT, env=sweep_env(), capture_output=True, text=True, timeout=300)
  assert got.returncode == 0, got.stderr[-3000:]
  report = (workdir / "report.md").read_text()
  rows = [line for line in report.splitlines() if line.startswith("| **")]
  assert [r.split("|")[1].strip() for r in rows] == ["**situ_glu**", "**swiglu**"]
  assert "`model.ffn.activation=swiglu`" in rows[1]
  assert all("(2/2)" in r for r in rows), rows   # both seeds' held-out loss
  figures = [line.split("](")[1].rstrip(")") for line in report.splitlines()
             if line.startswith("![")]
  assert {"final_eval_loss.png", "curves_all_arms.png", "cost.png", "expert_load.png"} <= set(
      figures)
  for name in figures:
    image = matplotlib.image.imread(workdir / name)
    assert image.ndim == 3 and min(image.shape[:2]) > 100, (name, image.shape)


# --- sweep files ---------------------------------------------------------------------------

def sweep_file(tmp_path, body: str) -> str:
  path = tmp_path / "sweep.py"
  path.write_text(f"def get_sweep(arg=None):\n  return {body}\n")
  return str(path)


BASE = '"config": "experiments/k3_tiny.py", "seeds": [0]'


@pytest.mark.parametrize("body,message", [
    (f"{{{BASE}}}", "no arms"),
    (f'{{{BASE}, "arms": []}}', "no arms"),
    (f'{{{BASE}, "arms": {{"a": {{}}}}}}', "must be a list of (name, overrides) pairs"),
    (f'{{{BASE}, "arms": [("a", {{}}), ("a", {{"model.mla_every": 2}})]}}',
     "two arms are named 'a'"),
    (f'{{{BASE}, "arms": [("a/b", {{}})]}}', "arm name 'a/b'"),
    (f'{{{BASE}, "arms": [("a", {{"seed": 3}})]}}', "the seeds come from 'seeds'"),
    ('{"config": "experiments/k3_tiny.py", "arms": [("a", {})], "seeds": [0, 0]}',
     "distinct ints"),
    (f'{{{BASE}, "arms": [("a", {{}})], "groups": {{"q": ["a", "b"]}}}}',
     "group 'q' names arms that are not defined: ['b']"),
    (f'{{{BASE}, "arms": [("a", {{}})], "arm": []}}', "unknown keys ['arm']"),
])
def test_a_bad_sweep_file_is_named(tmp_path, body, message):
  with pytest.raises(k3config.ConfigError, match="sweep .*: .*" + re.escape(message)):
    load_sweep(sweep_file(tmp_path, body))


def test_a_sweep_file_without_get_sweep_or_variant_is_named(tmp_path):
  path = tmp_path / "empty.py"
  path.write_text("ARMS = []\n")
  with pytest.raises(k3config.ConfigError, match="defines no get_sweep"):
    load_sweep(str(path))
  with pytest.raises(k3config.ConfigError, match="unknown variant 'huge'"):
    load_sweep(f"{OPEN_QUESTIONS}:huge")


@pytest.mark.parametrize("overrides,message", [
    ('{"model.mla_evry": 2}', "arm 'a': --config.model.mla_evry is not a field; did you mean "
                              "model.mla_every?"),
    ('{"model.mla_every": "two"}', "arm 'a': --config.model.mla_every=two: invalid literal"),
    ('{"model.kda.backend": "chunk"}',
     "arm 'a': config.model.kda.backend: 'chunk' was renamed 'reference'"),
])
def test_an_arm_that_is_not_a_valid_config_is_named(tmp_path, overrides, message):
  sweep = load_sweep(sweep_file(tmp_path, f'{{{BASE}, "arms": [("a", {overrides})]}}'))
  with pytest.raises(k3config.ConfigError, match=re.escape(message)):
    run_config(plan(sweep, str(tmp_path / "runs"))[0])


def test_the_command_line_says_it_in_one_line_and_writes_nothing(tmp_path):
  path = sweep_file(tmp_path, f'{{{BASE}, "arms": [("a", {{"model.mla_evry": 2}})]}}')
  got = subprocess.run([sys.executable, "-m", "k3jax.sweep", f"--sweep={path}",
                        f"--workdir={tmp_path / 'runs'}"], cwd=ROOT, env=sweep_env(),
                       capture_output=True, text=True, timeout=300)
  assert got.returncode == cli.EXIT_CONFIG_ERROR
  assert got.stderr == ("config error: arm 'a': --config.model.mla_evry is not a field; "
                        "did you mean model.mla_every?\n")
  assert not (tmp_path / "runs").exists()


def test_print_commands_prints_the_runs_for_a_launcher_and_runs_nothing(tmp_path):
  got = subprocess.run([sys.executable, "-m", "k3jax.sweep", f"--sweep={MICRO}",
                        f"--workdir={tmp_path}", "--print_commands"], cwd=ROOT,
                       env=sweep_env(), capture_output=True, text=True, timeout=300)
  assert got.returncode == 0, got.stderr[-3000:]
  lines = got.stdout.splitlines()
  assert lines[0].startswith("# 4 runs of experiments/sweeps/micro.py") and (
      "launch/slurm_gpu.sbatch" in lines[0])
  assert lines[2] == ("python -m k3jax.train --config=experiments/k3_tiny.py "
                      f"--workdir={tmp_path}/swiglu/seed0 " + " ".join(
                          f"--config.{k}={v}" for k, v in load_sweep(MICRO).overrides.items())
                      + " --config.model.ffn.activation=swiglu --config.seed=0")
  assert os.listdir(tmp_path) == ["sweep.json"]


def test_runs_go_seed_major_with_the_arms_overrides_then_the_seed(tmp_path):
  sweep = load_sweep(MICRO)
  runs = plan(sweep, str(tmp_path))
  assert [r.name for r in runs] == ["situ_glu/seed0", "swiglu/seed0", "situ_glu/seed1",
                                    "swiglu/seed1"]
  assert runs[3].args[:2] == ("--config=experiments/k3_tiny.py",
                              f"--workdir={tmp_path}/swiglu/seed1")
  assert runs[3].args[-2:] == ("--config.model.ffn.activation=swiglu", "--config.seed=1")


def test_parallel_runs_split_a_hosts_gpus_and_share_a_cpu(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
  assert device_slots(1) == [{}]   # one run: every device, as k3jax.train alone
  assert device_slots(4) == [{"CUDA_VISIBLE_DEVICES": g} for g in ("0,1", "2,3", "4,5", "6,7")]
  with pytest.raises(k3config.ConfigError, match="--parallel=9: this host has 8 GPUs"):
    device_slots(9)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert device_slots(2) == [{}, {}]
  with pytest.raises(k3config.ConfigError, match="--parallel must be >= 1"):
    device_slots(0)


# --- experiments/sweeps/open_questions.py ---------------------------------------------------

@pytest.mark.parametrize("variant", ["", ":small"])
def test_every_open_question_arm_is_a_valid_config_in_a_group(variant, tmp_path):
  sweep = load_sweep(OPEN_QUESTIONS + variant)
  assert len(sweep.seeds) >= 3
  grouped = {a for members in sweep.groups.values() for a in members}
  assert grouped == set(sweep.arms)
  firsts = {r.arm: r for r in plan(sweep, str(tmp_path)) if r.seed == sweep.seeds[0]}
  configs = {arm: run_config(run) for arm, run in firsts.items()}
  base = configs["baseline"]
  for arm, cfg in configs.items():
    for key, value in sweep.arms[arm].items():
      assert field(cfg, key) == value, (arm, key)
  assert base.model.moe.latent_dim * 2 == base.model.d_model   # K3's half-width latent
  assert configs["latent_full"].model.moe.latent_dim == base.model.d_model
  # KDA:MLA over the 8 cycle layers, then the final layer
  ratios = {"all_mla": (0, 8, "mla"), "kda1_mla1": (4, 4, "mla"), "kda7_mla1": (7, 1, "mla"),
            "all_kda": (8, 0, "kda")}
  ratios[sweep.groups["kda_mla_ratio"][2]] = (6, 2, "mla")
  for arm, (kda, mla, last) in ratios.items():
    mixers = layer_plan(configs[arm].model).mixers
    assert len(mixers) == 9 and mixers[:8].count("kda") == kda and mixers[:8].count(
        "mla") == mla and mixers[8] == last, (arm, mixers)


def field(cfg, dotted: str):
  for part in dotted.split("."):
    cfg = cfg[part]
  return cfg


def test_the_open_questions_record_holds_each_arms_config(tmp_path):
  from k3jax.sweep_spec import write_record  # noqa: PLC0415
  sweep = load_sweep(OPEN_QUESTIONS)
  record = write_record(sweep, plan(sweep, str(tmp_path)), str(tmp_path))
  assert json.loads((tmp_path / "sweep.json").read_text()) == record
  assert record["arms"]["softplus_gate"]["config"]["model"]["kda"]["gate"] == "softplus"
  assert len(record["runs"]) == len(sweep.arms) * len(sweep.seeds)

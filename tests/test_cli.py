"""The command line every entry point shares (k3jax.cli): a config's errors are one line
naming the key or field, exit status 2, no traceback, before anything is built; CPU runs
say nothing about libtpu."""

import importlib.util
import os
import subprocess
import sys

import pytest

from k3jax import cli
from k3jax import config as k3config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "--config=experiments/k3_tiny.py"
TYPO = "--config.model.attn_res.enabeld=False"
TYPO_LINE = ("config error: --config.model.attn_res.enabeld is not a field; did you mean "
             "model.attn_res.enabled?")


def run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
  """Runs the commands at once (each is mostly Python start-up and imports)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  procs = {k: subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for k, argv in commands.items()}
  out = {}
  for k, p in procs.items():
    stdout, stderr = p.communicate(timeout=300)
    out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
  return out


def test_config_errors_are_one_line(tmp_path):
  """A mistyped key names the full dotted key and the nearest valid one; an impossible value
  names its field (validate's ConfigError); both exit 2 with that one line on stderr and
  nothing written."""
  work = f"--workdir={tmp_path}"
  rs = run_all({
      "train typo": ["-m", "k3jax.train", TINY, TYPO, work],
      "params typo": ["-m", "k3jax.params", TINY, TYPO],
      "train invalid": ["-m", "k3jax.train", TINY, "--config.train.seq_len=1", work],
      "train share": ["-m", "k3jax.train", TINY, "--config.train.gpu_memory_fraction=1.5",
                      work],
  })
  wants = {"train invalid": "config.train.seq_len: must be >= 2, got 1",
           "train share": "config.train.gpu_memory_fraction: 1.5 must be in (0, 1], or 0 for "
                          "JAX's default"}
  for k, r in rs.items():
    want = TYPO_LINE if "typo" in k else f"config error: {wants[k]}"
    assert r.returncode == cli.EXIT_CONFIG_ERROR and r.stderr == want + "\n", (k, r.stderr)
  assert not os.listdir(tmp_path)


def test_every_entry_point_starts_through_cli_run():
  """Each program that reads --config (k3jax's entry points, the benchmarks) starts with
  cli.run, which reports config errors as above, not absl's app.run."""
  files = [os.path.join(d, f) for top in ("k3jax", "benchmarks")
           for d, _, names in os.walk(os.path.join(ROOT, top)) for f in names
           if f.endswith(".py")]
  readers = [f for f in files if "cli.CONFIG" in open(f).read()]
  names = {os.path.relpath(f, ROOT) for f in readers}
  assert {"k3jax/train.py", "k3jax/eval.py", "k3jax/generate.py", "k3jax/aot.py",
          "k3jax/params.py", "k3jax/convert/__main__.py"} <= names
  for f in readers:
    text = open(f).read()
    assert "\n  cli.run(" in text and "app.run(" not in text, f


def test_bad_values_and_files_are_one_line():
  """A value of the wrong type, a config file that is not there, no --config at all."""
  rs = run_all({
      "type": ["-m", "k3jax.params", TINY, "--config.train.steps=twenty"],
      "file": ["-m", "k3jax.params", "--config=experiments/k3_tny.py"],
      "none": ["-m", "k3jax.params"],
  })
  want = {
      "type": "config error: --config.train.steps=twenty: invalid literal for int()",
      "file": "config error: --config=experiments/k3_tny.py: [Errno 2] No such file",
      "none": "config error: --config=FILE[:arg] is required",
  }
  for k, r in rs.items():
    assert r.returncode == cli.EXIT_CONFIG_ERROR and r.stderr.startswith(want[k]), (k, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, (k, r.stderr)


@pytest.mark.parametrize("key,near", [
    ("model.attn_res.enabeld", "model.attn_res.enabled"),  # the last part
    ("modle.atn_res.enabled", "model.attn_res.enabled"),   # groups on the way
    ("attn_res.enabled", "model.attn_res.enabled"),        # a group left out
    ("train.stpes", "train.steps"),
    ("optimizer.muon.nsteps", "optimizer.muon.ns_steps"),
])
def test_nearest_field(key, near):
  cfg = k3config.base_config()
  assert cli.nearest_field(cfg, key) == near
  assert cli.unknown_field(cfg, key) == f"--config.{key} is not a field; did you mean {near}?"


def test_unknown_field_says_why():
  cfg = k3config.base_config()
  assert cli.unknown_field(cfg, "model.attn_res.enabled") is None
  assert cli.unknown_field(cfg, "model.kda.xyzzy") == "--config.model.kda.xyzzy is not a field"
  assert cli.unknown_field(cfg, "train.steps.x") == (
      "--config.train.steps.x is not a field: config.train.steps is a value (int), not a "
      "group of fields")
  assert cli.unknown_field(cfg, "data.sources[0].paths") == (
      "--config.data.sources[0].paths is not a field: config.data.sources has 0 entries")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_cpu_runs_say_nothing_about_libtpu():
  """With libtpu installed and no TPU chip, neither JAX's search for backends nor a
  compile-only TPU topology (k3jax.aot) prints libtpu's errors about the missing TPU VM
  metadata, once `quiet_libtpu` has run."""
  code = ("from k3jax import cli; cli.quiet_libtpu(); import jax; print(jax.devices()); "
          "from jax.experimental import topologies; "
          "print(len(topologies.get_topology_desc(topology_name='v5p:2x2x1', "
          "platform='tpu').devices))")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env, PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines() == ["[CpuDevice(id=0)]", "4"]
  assert r.stderr == "", r.stderr

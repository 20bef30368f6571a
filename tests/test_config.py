"""Configs: the experiment files load and validate; impossible settings name their field."""

import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import set_field
from k3jax import config as k3config
from k3jax import params as k3params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def experiment(name):
  import importlib.util  # noqa: PLC0415
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load(name, variant=None):
  return experiment(name).get_config(variant)


@pytest.mark.parametrize("name", ["k3_full", "k3_small", "k3_tiny"])
def test_experiments_validate(name):
  """Every experiment and each of its named variants (`VARIANTS`) is a valid config; an
  unknown variant is refused with the known ones named."""
  for variant in {None, *getattr(experiment(name), "VARIANTS", ())}:
    k3config.validate(load(name, variant))
  if hasattr(experiment(name), "VARIANTS"):
    with pytest.raises(ValueError, match="unknown variant"):
      load(name, "no-such-variant")


@pytest.mark.parametrize("field,value,match", [
    ("model.moe.latent_dim", 8192, "latent 8192 is wider than the hidden"),
    ("model.moe.top_k", 900, "top_k"),
    ("model.mla.q_lora_rank", 9000, "wider than d_model"),
    ("model.kda.chunk_size", 48, "model.kda.chunk_size"),
    ("model.kda.conv_backend", "triton", "model.kda.conv_backend"),
    ("model.remat", "some", "model.remat"),
    ("model.moe.dispatch", "ragged", "model.moe.dispatch"),
    ("model.moe.gmm_backend", "triton", "model.moe.gmm_backend"),
    ("model.moe.expert_quant", "int4", "model.moe.expert_quant: must be one of"),
    ("optimizer.name", "sgd", "unknown optimizer"),
    ("train.microbatches", 3, "train.microbatches"),
    ("train.loss_chunk", 1000, "train.loss_chunk"),
    ("train.keep_checkpoint_every", 1500, "train.keep_checkpoint_every"),
    ("data.source", "files", "config.data.sources"),
    ("train.xla_options", "latency_hiding=false", "train.xla_options: 'latency_hiding=false'"),
    ("train.xla_options", "xla_tpu_foo", "train.xla_options: 'xla_tpu_foo' is not"),
    ("data.tokenizer.kind", "wordpiece", "config.data.tokenizer"),
])
def test_impossible_settings_name_the_field(field, value, match):
  c = load("k3_full")
  set_field(c, field, value)
  with pytest.raises(k3config.ConfigError, match=match):
    k3config.validate(c)


def test_mxfp4_experts_need_whole_groups():
  """MXFP4 scales groups of 32 input columns: k3_full's experts (latent 3,584, hidden
  3,072) take it; a hidden size of 3,000 is refused with both sizes named."""
  c = load("k3_full")
  c.model.moe.expert_quant = "mxfp4"
  k3config.validate(c)
  c.model.moe.expert_dim = 3_000
  with pytest.raises(k3config.ConfigError, match="latent_dim 3584 and expert_dim 3000"):
    k3config.validate(c)


def test_the_softplus_gate_runs_on_every_backend():
  """The unbounded (softplus) gate is a valid config with every KDA backend, the kernels
  included; gate_lower_bound (which bounds only K3's gate) is not checked for it."""
  c = load("k3_full")
  c.model.kda.gate = "softplus"
  c.model.kda.gate_lower_bound = -10.0
  for backend in ("auto", "reference", "naive", "kernel", "interpret"):
    c.model.kda.backend = backend
    k3config.validate(c)
  c.model.kda.gate = "bounded"
  with pytest.raises(k3config.ConfigError, match="gate_lower_bound: -10.0 is below -5"):
    k3config.validate(c)


def test_an_old_kda_backend_name_is_told_its_new_one():
  c = load("k3_tiny")
  c.model.kda.backend = "chunk"
  with pytest.raises(k3config.ConfigError, match="model.kda.backend: 'chunk' was renamed "
                                                 "'reference'"):
    k3config.validate(c)


def test_unknown_key_is_an_error():
  c = load("k3_tiny")
  with pytest.raises(AttributeError, match="d_modle"):
    c.model.d_modle = 3


def run_params(*flags):
  return subprocess.run([sys.executable, "-m", "k3jax.params", *flags], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_full_parameter_count():
  """2.7795T total and 104.19B active (K3_SPEC section 1) within 0.2%, from eval_shape."""
  rows, total, active = k3params.count(load("k3_full"))
  assert abs(total / 2.7795e12 - 1) < 2e-3, total
  assert abs(active / 1.0419e11 - 1) < 2e-3, active
  assert rows["moe_routed_experts"] > 0.9 * total


def test_params_cli_last_line_is_json():
  """The table's columns align (each as wide as its widest entry), then the JSON line."""
  r = run_params("--config=experiments/k3_small.py")
  assert r.returncode == 0, r.stderr
  *table, last = r.stdout.strip().splitlines()
  out = json.loads(last)
  assert 1e9 <= out["total"] <= 3e9 and out["active"] < out["total"]
  assert_aligned(table)


def assert_aligned(lines):
  """Names start each line; counts end at one column, shares (where given) at another."""
  assert lines[0].split() == ["component", "parameters", "share"]
  count_end = lines[0].index("parameters") + len("parameters")
  for line in lines[1:]:
    name, count, *share = line.split()
    assert line.startswith(name + " ") and line.index(count) + len(count) == count_end, lines
    assert not share or len(line) == len(lines[0]), lines


def test_params_table_columns_align():
  """A component name longer than the header, and counts wider than it, stay in columns."""
  rows = {"moe_router_latent_shared": 147_968, "norms": 2_432, "a": 2_722_740_830_208}
  total = sum(rows.values())
  lines = k3params.table(rows, total, 12_345).splitlines()
  assert_aligned(lines)
  assert [line.split()[0] for line in lines] == ["component", "a", "moe_router_latent_shared",
                                                 "norms", "total", "active"]
  assert lines[-2].split()[1] == f"{total:,}" and lines[1].split()[2] == "100.00%"


def test_warmup_longer_than_the_run_is_cut_to_a_tenth(capsys):
  """A 20-step smoke run of k3_tiny (warmup 30): the warmup becomes 2 steps, one line on
  stderr says so, and the schedule peaks at step 2 and decays to its floor at step 20. A
  warmup within the run is left alone, silently."""
  from k3jax.optim.factory import make_schedule  # noqa: PLC0415
  c = load("k3_tiny")
  c.train.steps = 20
  k3config.validate(c)
  assert c.optimizer.warmup_steps == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["config: optimizer.warmup_steps=30 is longer than train.steps=20: warming "
                 "up over 2 steps (a tenth of the run)"]
  s, lr, floor = make_schedule(c), c.optimizer.learning_rate, c.optimizer.min_lr_ratio
  assert float(s(0)) == 0.0 and abs(float(s(2)) - lr) < 1e-9
  assert abs(float(s(20)) - lr * floor) < 1e-9
  c = load("k3_tiny")
  c.train.steps = 30
  k3config.validate(c)
  assert c.optimizer.warmup_steps == 30 and capsys.readouterr().err == ""
  c.optimizer.warmup_steps = -1
  with pytest.raises(k3config.ConfigError, match="optimizer.warmup_steps: must be >= 0"):
    k3config.validate(c)


def test_xla_options_apply_on_their_platform():
  """An xla_tpu_* / xla_gpu_* / xla_cpu_* option reaches only its platform's compiler, any
  other every platform's; commas or spaces split them, leading dashes are allowed."""
  spec = "--xla_tpu_a=false, xla_gpu_b=2 xla_dump_to=/tmp/x"
  assert k3config.xla_options(spec, "tpu") == {"xla_tpu_a": "false", "xla_dump_to": "/tmp/x"}
  assert k3config.xla_options(spec, "gpu") == {"xla_gpu_b": "2", "xla_dump_to": "/tmp/x"}
  assert k3config.xla_options(spec, "cpu") == {"xla_dump_to": "/tmp/x"}
  assert k3config.xla_options("", "tpu") == {}


def test_xla_bool_options_reach_the_cpu_compiler():
  """XLA's CPU / GPU options refuse "false" as a bool; the program passes it as one."""
  from k3jax import program  # noqa: PLC0415
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
  assert program.compiler_options("xla_allow_excess_precision=false xla_cpu_enable_fast_math"
                                  "=TRUE", mesh) == {"xla_allow_excess_precision": False,
                                                     "xla_cpu_enable_fast_math": True}


def test_deterministic_adds_the_platforms_options_which_xla_knows():
  """train.deterministic: XLA's deterministic ops on GPU (options XLA accepts: compiled
  here with them), nothing to add where steps repeat anyway; an explicit xla_options
  item wins."""
  from k3jax import program  # noqa: PLC0415
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
  assert program.compiler_options("", mesh, deterministic=True) is None
  gpu = {k: v == "true" for k, v in program.DETERMINISTIC["gpu"].items()}
  jax.jit(lambda x: x + 1, compiler_options=gpu).lower(1.0).compile()
  assert program.compiler_options("xla_allow_excess_precision=false", mesh,
                                   deterministic=True) == {"xla_allow_excess_precision": False}

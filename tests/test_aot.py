"""`k3jax.aot`: the train step compiled for a TPU slice on this CPU (libtpu), and the
refusal of a configuration that cannot fit, before any compile."""

import os
import subprocess
import sys

import jax
import pytest
from tpu_aot import tpu_mesh

from conftest import micro_config
from k3jax import aot, memory, program
from k3jax import config as k3config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_kernel_config():
  """micro_config cut to one hybrid cycle + the final MLA, with the KDA Pallas kernels and
  the Newton-Schulz kernel ("auto" picks Mosaic on TPU), bf16 compute."""
  cfg = micro_config()
  with cfg.unlocked():
    cfg.model.num_layers = 5
    cfg.model.dtype = "bfloat16"
    cfg.model.kda.backend = "kernel"
    cfg.mesh.data, cfg.mesh.fsdp = 2, 2
  return k3config.validate(cfg)


@pytest.mark.slow
def test_train_step_compiles_for_a_v5p_slice():
  """The whole train step (forward, backward, Muon + AdamW, Quantile Balancing, QK-Clip)
  lowers with both Pallas kernels as Mosaic calls and compiles for v5p 2x2x1 (data 2 x
  fsdp 2); the report holds the compiled memory and FLOPs and it fits a v5p chip."""
  cfg = tiny_kernel_config()
  mesh = tpu_mesh(("data", "fsdp", "expert", "tensor"), (2, 2, 1, 1))
  prog = program.build(cfg, mesh)
  hlo = prog.lower_train_step().as_text()
  assert hlo.count("tpu_custom_call") >= 2  # KDA (forward and backward) and Newton-Schulz
  report, _ = memory.compile_report(prog)
  assert report.device_kind == "TPU v5" and report.chips == 4
  assert report.capacity_bytes == 95 * memory.GIB and report.fits
  # The donated state comes back in place; the arguments hold at least this chip's state.
  assert report.alias_bytes > 0
  assert report.argument_bytes >= memory.state_bytes_per_chip(prog)
  assert report.flops_per_chip > 0
  text = "\n".join(report.lines(step_time=1.0))
  assert "HBM per chip: total" in text and "MFU" in text and text.endswith("fits")


def test_state_bytes_per_chip_follow_the_shardings():
  """fsdp shards parameters and optimizer state: 4-way fsdp needs about a quarter of the
  per-chip state of pure data parallelism (replicated arrays: every chip holds them)."""
  cfg = micro_config()
  data = program.build(cfg, tpu_mesh(("data", "fsdp", "expert", "tensor"), (4, 1, 1, 1)))
  fsdp = program.build(cfg, tpu_mesh(("data", "fsdp", "expert", "tensor"), (1, 4, 1, 1)))
  full = data.state_bytes
  assert memory.state_bytes_per_chip(data) == full
  assert full / 4 <= memory.state_bytes_per_chip(fsdp) < full / 2


def test_k3_full_on_four_chips_is_refused_before_compiling():
  """The CLI says why (the need and the capacity per chip) and exits 1, in seconds."""
  if not any(d.platform == "cpu" for d in jax.devices()):
    pytest.skip("runs the CLI on a CPU host")
  tpu_mesh(("data",))  # skips where libtpu is missing
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "k3jax.aot", "--config=experiments/k3_full.py",
       "--topology=v5p:2x2x1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "DOES NOT FIT: the train state alone needs" in proc.stdout
  assert "but a TPU v5 has 95 GiB" in proc.stdout


def test_unknown_topology_is_named():
  tpu_mesh(("data",))
  with pytest.raises(ValueError, match="--topology=v9z:1x1: no such TPU topology"):
    aot.topology_devices("v9z:1x1")


def test_train_refuses_a_state_that_cannot_fit_before_making_anything(tmp_path, monkeypatch):
  """`k3jax.train` runs the same check where the device's HBM is known (TPU, GPU; here a
  pretend 1 KiB device): it stops with the need and the capacity before any state or
  checkpoint exists."""
  from k3jax import train as k3train  # noqa: PLC0415
  monkeypatch.setattr(memory, "hbm_bytes", lambda device: 1024)
  cfg = micro_config()
  cfg.model.vocab_size, cfg.train.global_batch = 384, 8
  with pytest.raises(MemoryError, match=r"the train state alone needs .* GiB per chip"):
    k3train.train(cfg, str(tmp_path))
  assert not os.listdir(tmp_path / "checkpoints")

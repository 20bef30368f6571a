"""`k3jax.aot`: the train step compiled for a TPU slice on this CPU (libtpu), and the
refusal of a configuration that cannot fit, before any compile or by XLA's compile; k3_full's
named slice variants; the dropless MoE dispatch compiled to TPU grouped-matmul kernels.
Multi-slice compiles: tests/test_multislice.py."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from tpu_aot import tiny_kernel_config, tpu_devices, tpu_mesh

from conftest import micro_config
from experiments import k3_full
from k3jax import aot, axes, memory, parallel, program
from k3jax import config as k3config
from k3jax.model.latent_moe import LatentMoE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_compiles_for_a_v5p_slice():
  """The whole train step (forward, backward, Muon + AdamW, Quantile Balancing, QK-Clip)
  lowers with both Pallas kernels as Mosaic calls and compiles for v5p 2x2x1 (data 2 x
  fsdp 2); the report holds the compiled memory and FLOPs and it fits a v5p chip (~40 s
  on this 2-core host)."""
  cfg = tiny_kernel_config()
  mesh = tpu_mesh(parallel.MESH_AXES, (2, 2, 1, 1, 1))
  prog = program.build(cfg, mesh)
  hlo = prog.lower_train_step().as_text()
  assert hlo.count("tpu_custom_call") >= 2  # KDA (forward and backward) and Newton-Schulz
  report, _ = memory.compile_report(prog)
  assert report.device_kind == "TPU v5" and report.chips == 4
  assert report.capacity_bytes == 95 * memory.GIB and report.fits
  assert report.allocator_bytes is None  # compile-only devices have no allocator
  # The donated state comes back in place; the arguments hold at least this chip's state.
  assert report.alias_bytes > 0
  assert report.argument_bytes >= memory.state_bytes_per_chip(prog)
  assert report.flops_per_chip > 0
  text = "\n".join(report.lines(step_time=1.0))
  assert "HBM per chip: total" in text and "MFU" in text and text.endswith("fits")


def test_a_step_over_the_allocators_share_is_refused_naming_it():
  """A GPU step within the card's HBM but over what this process's allocator may use (JAX's
  default share: 75%) does not fit, and the error says which limit and how to raise it; a
  device that reports no limit (CPU, compile-only) leaves the capacity alone."""
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      if isinstance(self.stats, Exception):
        raise self.stats
      return self.stats
  assert memory.allocator_bytes(Device({"bytes_limit": 60 * memory.GIB})) == 60 * memory.GIB
  assert memory.allocator_bytes(Device(None)) is None
  assert memory.allocator_bytes(Device(RuntimeError("compile-only"))) is None
  gib = memory.GIB
  report = memory.Report(
      device_kind="NVIDIA H100 80GB HBM3", chips=1, mesh={}, argument_bytes=24 * gib,
      output_bytes=0, alias_bytes=0, temp_bytes=40 * gib, code_bytes=0,
      capacity_bytes=80 * gib, flops_per_chip=None, tokens_per_step=1, compile_seconds=1.0,
      allocator_bytes=60 * gib)
  assert report.usable_bytes == 60 * gib and report.fits is False
  assert "total 64.00 GiB of 80.00 GiB (this process's allocator: 60.00 GiB)" in "\n".join(
      report.lines())
  with pytest.raises(MemoryError, match=r"needs 64.00 GiB .* within a NVIDIA H100 80GB HBM3's "
                     r"80 GiB but over the 60.00 GiB .* config.train.gpu_memory_fraction \(or "
                     r"XLA_PYTHON_CLIENT_MEM_FRACTION"):
    memory.check_fits(report)
  roomy = dataclasses.replace(report, allocator_bytes=None)
  assert roomy.fits and roomy.usable_bytes == 80 * gib
  memory.check_fits(roomy)
  with pytest.raises(MemoryError, match=r"needs 104.00 GiB .* but a NVIDIA H100 80GB HBM3 "
                     r"has 80 GiB"):
    memory.check_fits(dataclasses.replace(report, temp_bytes=80 * gib))


def test_the_configs_gpu_share_is_set_before_jax_starts_and_refused_after(monkeypatch):
  """train.gpu_memory_fraction becomes the allocator's share when set before JAX starts its
  backends (replacing the environment's, said on stderr); once they have started, another
  share is refused, naming both; the share it already has passes."""
  var = memory.SHARE_VARIABLE
  monkeypatch.setenv(var, "0.8")
  code = ("import os, jax; from k3jax import memory; memory.claim_gpu_share(0.9); "
          "jax.devices(); print(os.environ[memory.SHARE_VARIABLE])")
  r = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: "0.5"},
                     capture_output=True, text=True, check=True)
  assert r.stdout == "0.9\n"
  assert f"train.gpu_memory_fraction=0.9 replaces {var}=0.5" in r.stderr
  jax.devices()  # this process's backends have started
  with pytest.raises(k3config.ConfigError, match=rf"gpu_memory_fraction=0.93: JAX's backends "
                     rf"have already started with {var}=0.8"):
    memory.claim_gpu_share(0.93)
  memory.claim_gpu_share(0.8)
  memory.claim_gpu_share(0.0)  # 0: the environment's share stays
  assert os.environ[var] == "0.8"


def test_state_bytes_per_chip_follow_the_shardings():
  """fsdp shards parameters and optimizer state: 4-way fsdp needs about a quarter of the
  per-chip state of pure data parallelism (replicated arrays: every chip holds them)."""
  cfg = micro_config()
  data = program.build(cfg, tpu_mesh(parallel.MESH_AXES, (4, 1, 1, 1, 1)))
  fsdp = program.build(cfg, tpu_mesh(parallel.MESH_AXES, (1, 4, 1, 1, 1)))
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


def test_preflight_refuses_k3_full_on_four_chips_from_the_shardings():
  """`memory.preflight`, which `k3jax.train` runs before it makes any state, on a
  compile-only v5p mesh of 4 chips: k3_full's state is refused from the shardings alone
  (nothing compiled, nothing logged), naming the need per chip and the chip's capacity."""
  mesh = tpu_mesh(parallel.MESH_AXES, (1, 4, 1, 1, 1))
  prog = program.build(k3config.validate(k3_full.get_config()), mesh)
  logged = []
  with pytest.raises(MemoryError, match=r"the train state alone needs ([\d,.]+) GiB per chip "
                     r".* but a TPU v5 has 95 GiB") as e:
    memory.preflight(prog, log=logged.append)
  need = float(re.search(r"needs ([\d,.]+) GiB", str(e.value)).group(1).replace(",", ""))
  assert need * memory.GIB >= prog.state_bytes / 4 and not logged


def test_preflight_refuses_a_step_xla_cannot_fit():
  """A state that fits but a step that cannot: XLA's compile for v5p refuses it (here a
  step whose result alone is 256 GiB per chip, so the compile stays cheap), and
  `preflight` turns that into a MemoryError naming the chip, its capacity and XLA's need."""
  mesh = tpu_mesh(parallel.MESH_AXES, (4, 1, 1, 1, 1))
  prog = program.build(k3config.validate(micro_config()), mesh)
  huge = jax.jit(lambda params, rest, opt_state, batch: jnp.sin(
      jnp.arange(2 ** 38, dtype=jnp.float32).reshape(4, -1) + jnp.sum(batch["weights"])),
      out_shardings=NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  prog = dataclasses.replace(prog, train_step=huge)
  with pytest.raises(MemoryError, match=r"does not fit a TPU v5's HBM of 95 GiB per chip .*"
                     r"Ran out of memory"):
    memory.preflight(prog, log=lambda line: None)


def test_a_one_slice_pod_is_one_slice():
  """libtpu's one-slice topologies give no `slice_index`; the 16 hosts of v5p 4x4x4 are
  still one slice: one ICI mesh, no axis across slices."""
  devices = tpu_devices("v5p:4x4x4")
  assert len({d.process_index for d in devices}) == 16
  assert [len(g) for g in parallel.slices(devices)] == [64]
  cfg = micro_config()
  cfg.mesh.data, cfg.mesh.fsdp = 4, 16
  mesh = parallel.make_mesh(cfg.mesh, devices)
  assert dict(mesh.shape)["fsdp"] == 16 and set(parallel.slices_along(mesh).values()) == {1}


def test_an_axis_may_split_a_physical_axis_when_asked():
  """fsdp 4 x context 2 on the 8-chip x ring of v5p 8x8x16 (expert over y x z): refused by
  default, naming mesh.split_physical_axes; with it, each context pair is two neighbouring
  chips and fsdp strides over the ring."""
  devices = aot.topology_devices("v5:8x8x16", chip_config="megacore",
                                 chips_per_host_bounds=(2, 2, 1))
  cfg = micro_config()
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.context = 1, 4, 128, 2
  with pytest.raises(k3config.ConfigError, match="mesh.split_physical_axes"):
    parallel.make_mesh(cfg.mesh, devices)
  cfg.mesh.split_physical_axes = True
  mesh = parallel.make_mesh(cfg.mesh, devices)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 128, "context": 2, "tensor": 1}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  pair = [d.coords for d in mesh.devices[0, 0, 0, :, 0]]
  assert sum(abs(a - b) for a, b in zip(*pair)) == 1


def test_xla_options_reach_the_tpu_compiler():
  """config.train.xla_options is compiled into the steps: with XLA:TPU's latency-hiding
  scheduler off (what fits k3_full:tpu7x-1024) the eval step of a v5p fsdp mesh compiles to
  another program than with the defaults (XLA's compile is deterministic). An option that
  XLA:TPU does not know is refused when the program is built, naming the field; a TPU
  option is left out on a CPU mesh."""
  mesh = tpu_mesh(parallel.MESH_AXES, (1, 4, 1, 1, 1))

  def eval_program(options):
    cfg = micro_config()
    cfg.train.xla_options = options
    prog = program.build(k3config.validate(cfg), mesh)
    with prog.rules():
      return prog.eval_step.lower(*prog.abstract_state[:2], prog.abstract_batch()).compile()

  default = eval_program("")
  lhs_off = eval_program("xla_tpu_enable_latency_hiding_scheduler=false")
  assert default.as_text() != lhs_off.as_text()
  with pytest.raises(k3config.ConfigError, match=r"config.train.xla_options: XLA on tpu refuses "
                     r".*xla_tpu_no_such_option"):
    eval_program("xla_tpu_no_such_option=1")
  cpu_mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
  assert program.compiler_options("xla_tpu_no_such_option=1", cpu_mesh) is None


@pytest.mark.parametrize("name", sorted(k3_full.VARIANTS))
def test_k3_full_variant_tiles_its_slice_and_holds_its_state(name):
  """A named variant (`--config=experiments/k3_full.py:<name>`) is a valid config whose
  explicit mesh multiplies to its topology's device count, lays out on that slice's
  physical axes and holds the train state within a chip's HBM (from the shardings; the
  compiled numbers: benchmarks/results/aot_k3_full.md)."""
  tpu_devices()  # skips where libtpu is missing
  variant = k3_full.VARIANTS[name]
  cfg = k3config.validate(k3_full.get_config(name))
  devices = aot.topology_devices(**variant["topology"])
  sizes = [cfg.mesh[a] for a in parallel.MESH_AXES]
  assert -1 not in sizes and math.prod(sizes) == len(devices)
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, devices))
  capacity = memory.hbm_bytes(devices[0])
  assert memory.check_state_fits(prog, capacity) <= capacity


def test_unknown_k3_full_variant_is_named():
  with pytest.raises(ValueError, match="k3_full.py:v9-1: unknown variant"):
    k3_full.get_config("v9-1")


def _latent_moe_grad_lowered(dispatch, mesh):
  """LatentMoE (micro sizes, bf16) forward + backward lowered on abstract arrays under
  `mesh`'s rules: d/d(params, x) of sum(y^2), x [8, 32, d] split over the batch axes."""
  cfg = micro_config()
  cfg.model.moe.dispatch, cfg.model.dtype = dispatch, "bfloat16"
  m = k3config.validate(cfg).model
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: LatentMoE(m, rngs=nnx.Rngs(0))),
                                     nnx.Param, ...)

  def loss(params, rest, x):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  def spec(state):
    return jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                        nnx.as_pure(state), parallel.shardings(mesh, state))
  x = jax.ShapeDtypeStruct((8, 32, m.d_model), jnp.float32,
                           sharding=NamedSharding(mesh, parallel.batch_spec()))
  with axes.use_rules(mesh, parallel.RULES):
    return jax.jit(jax.grad(loss, (0, 2))).lower(spec(params), spec(rest), x)


def test_dropless_moe_runs_its_experts_as_tpu_ragged_dot_kernels():
  """The dropless dispatch on a v5p mesh: its grouped matmuls lower to `chlo.ragged_dot`,
  which XLA:TPU compiles to `ragged-dot-*` TPU custom calls (grouped-matmul kernels): the
  three expert matmuls forward and their input gradients, at least. (At these sizes XLA
  computes the weight gradients as masked convolutions.)"""
  mesh = tpu_mesh(parallel.MESH_AXES, (4, 1, 1, 1, 1))
  lowered = _latent_moe_grad_lowered("dropless", mesh)
  assert "chlo.ragged_dot" in lowered.as_text()
  hlo = lowered.compile().as_text()
  kernels = re.findall(r"%(ragged-dot-\S+) = .*custom_call_target=\"(\w+)\"", hlo)
  matmuls = [name for name, target in kernels if not name.startswith("ragged-dot-metadata")]
  assert len(matmuls) >= 6, kernels
  assert {target for _, target in kernels} == {"tpu_custom_call"}


def test_auto_dispatch_follows_the_mesh_platform():
  """moe.dispatch="auto" lowers to the very program of "expert_parallel_dropless" on a v5p
  mesh (compiled for TPU from this CPU host) and to that of "capacity" on a CPU mesh."""
  cfg = micro_config()
  cfg.mesh.data = 4
  for mesh, want, other in [(tpu_mesh(parallel.MESH_AXES, (4, 1, 1, 1, 1)),
                             "expert_parallel_dropless", "capacity"),
                            (parallel.make_mesh(cfg.mesh, jax.devices()[:4]), "capacity",
                             "dropless")]:
    text = {d: _latent_moe_grad_lowered(d, mesh).as_text() for d in ("auto", want, other)}
    assert text["auto"] == text[want] != text[other]


@pytest.mark.parametrize("shape,exchanges,rows", [((4, 1, 1, 1, 1), 0, 128),
                                                  ((1, 1, 4, 1, 1), 4, 512)],
                         ids=["data4", "expert4"])
def test_expert_parallel_dropless_compiles_for_tpu(shape, exchanges, rows):
  """moe.dispatch="expert_parallel_dropless" on v5p: each device sorts its own 2 x 32 x 2
  = 128 (token, slot) pairs; over expert=4 the rows cross by ragged all-to-all (forward
  and back, and both again in the backward) into a worst-case buffer of 4 x 128 rows that
  the local experts' grouped-matmul kernels run on; over data=4 there is no exchange."""
  mesh = tpu_mesh(parallel.MESH_AXES, shape)
  hlo = _latent_moe_grad_lowered("expert_parallel_dropless", mesh).compile().as_text()
  assert len(re.findall(r"= \S+ ragged-all-to-all\(", hlo)) == exchanges
  kernels = re.findall(r"%ragged-dot-none\S* = \w+\[(\d+),\d+\].*custom_call_target=\""
                       r"tpu_custom_call\"", hlo)
  assert len(kernels) >= 6 and {int(r) for r in kernels} == {rows}, kernels

"""Multi-slice TPU meshes (`config.mesh.dcn_<axis>`) on a compile-only topology of two v5p
2x2x1 slices (libtpu): each slice's devices sit together in the ICI part of every axis and
only the DCN axes cross slices; the train step compiles for two slices with data parallelism
over DCN, its only cross-slice traffic being all-reduces (the gradient sums), and reports
its per-chip memory; impossible DCN splits are refused with the field named."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from tpu_aot import tiny_kernel_config, tpu_devices

from conftest import micro_config
from k3jax import memory, parallel, program
from k3jax.config import ConfigError, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICES = 2  # of v5p:2x2x1, 4 chips each


def _cfg(cfg=None, **mesh):
  c = cfg or micro_config()
  for axis in parallel.MESH_AXES:
    c.mesh[axis] = mesh.get(axis, 1)
    c.mesh[f"dcn_{axis}"] = mesh.get(f"dcn_{axis}", 1)
  return validate(c)


def _slice_ids(mesh):
  return np.vectorize(lambda d: d.slice_index)(mesh.devices)  # [data, fsdp, expert, tensor]


@pytest.mark.parametrize("sizes,across", [
    (dict(data=2, dcn_data=2, fsdp=4), "data"),
    (dict(data=2, fsdp=2, dcn_fsdp=2, tensor=2), "fsdp"),
    (dict(expert=4, dcn_expert=2, tensor=2), "expert"),
], ids=["data", "fsdp", "expert"])
def test_each_slice_is_one_block_of_the_dcn_axis(sizes, across):
  """Along the DCN axis the slice is the outer index (the first size / dcn positions are
  slice 0, the rest slice 1); along every other axis the slice never changes. Each slice's
  block holds its 4 chips once each, in the arrangement one slice alone would get."""
  devices = tpu_devices(num_slices=SLICES)
  mesh = parallel.make_mesh(_cfg(**sizes).mesh, devices)
  assert dict(mesh.shape) == {a: sizes.get(a, 1) for a in parallel.MESH_AXES}
  ids = _slice_ids(mesh)
  axis = parallel.MESH_AXES.index(across)
  ici = mesh.shape[across] // SLICES
  for s in range(SLICES):
    block = np.take(ids, range(s * ici, (s + 1) * ici), axis=axis)
    assert (block == s).all(), (across, s, ids)
    chips = np.take(mesh.devices, range(s * ici, (s + 1) * ici), axis=axis)
    assert sorted(d.id for d in chips.flat) == sorted(d.id for d in devices
                                                      if d.slice_index == s)
    one = parallel.make_mesh(_cfg(**{**sizes, across: ici, f"dcn_{across}": 1}).mesh,
                             [d for d in devices if d.slice_index == s])
    assert [d.coords for d in chips.flat] == [d.coords for d in one.devices.flat]
  assert parallel.slices_along(mesh) == {a: SLICES if a == across else 1
                                         for a in parallel.MESH_AXES}


def test_one_slice_and_cpu_meshes_are_unchanged():
  """Without DCN fields the mesh is jax.make_mesh's, on one TPU slice and on CPU devices."""
  auto = (jax.sharding.AxisType.Auto,) * len(parallel.MESH_AXES)
  for devices, sizes in [(tpu_devices(), dict(data=2, fsdp=2)),
                         (jax.devices(), dict(data=2, fsdp=2, tensor=2))]:
    mesh = parallel.make_mesh(_cfg(**sizes).mesh, devices)
    want = jax.make_mesh(tuple(sizes.get(a, 1) for a in parallel.MESH_AXES),
                         parallel.MESH_AXES, devices=devices, axis_types=auto)
    assert mesh == want


@pytest.mark.parametrize("sizes,devices,error", [
    (dict(data=8), "two slices",
     r"config.mesh.dcn_\*: the devices form 2 slice\(s\), but the DCN sizes \(all 1\) "
     r"multiply to 1; .* \(e.g. mesh.dcn_data=2\)"),
    (dict(data=4, dcn_data=4, fsdp=2), "two slices",
     r"config.mesh.dcn_\*: the devices form 2 slice\(s\), but the DCN sizes "
     r"\(\{'dcn_data': 4\}\) multiply to 4"),
    (dict(data=-1, dcn_data=2, fsdp=2), "one slice",
     r"config.mesh.dcn_\*: the devices form 1 slice\(s\).*every mesh.dcn_\* is 1"),
    (dict(data=-1, dcn_data=2, fsdp=8), "two slices",
     r"config.mesh.dcn_data: 2 slices do not divide mesh.data = 1"),
    (dict(data=2, dcn_data=2, fsdp=4), "cpu", r"config.mesh.dcn_\*: the devices form 1 slice"),
], ids=["no-dcn", "too-many", "one-slice", "fill-too-small", "cpu"])
def test_impossible_dcn_splits_are_named(sizes, devices, error):
  devices = {"two slices": lambda: tpu_devices(num_slices=SLICES), "one slice": tpu_devices,
             "cpu": jax.devices}[devices]()
  with pytest.raises(ConfigError, match=error):
    parallel.make_mesh(_cfg(**sizes).mesh, devices)


@pytest.mark.parametrize("sizes,error", [
    (dict(data=4, dcn_data=3), r"config.mesh.dcn_data: 3 slices do not divide mesh.data=4"),
    (dict(fsdp=2, dcn_fsdp=0), r"config.mesh.dcn_fsdp: must be >= 1"),
])
def test_validate_names_the_dcn_field(sizes, error):
  with pytest.raises(ConfigError, match=error):
    _cfg(**sizes)


def _megascale_transfers(hlo: str) -> set[str]:
  """The kinds of cross-slice (DCN) transfers of a compiled multi-slice TPU program."""
  return set(re.findall(r'_xla_megascale_transfer_type="(\w+)"', hlo))


def _ici_groups(hlo: str) -> list[list[int]]:
  """The device groups of the in-slice collectives (all-reduce, all-gather, ...)."""
  groups = []
  for text in re.findall(r"replica_groups=\{(\{[\d,{}]*\})\}", hlo):
    groups += [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", text)]
  return groups


def _two_slice_program():
  """A two-layer micro model (a dense layer and a LatentMoE one) on two slices: fsdp 4
  within each slice, data 2 across."""
  cfg = micro_config()
  cfg.model.num_layers, cfg.train.global_batch = 2, 8
  cfg.model.moe.dispatch = "auto"
  cfg = _cfg(cfg, data=2, dcn_data=2, fsdp=4)
  return program.build(cfg, parallel.make_mesh(cfg.mesh, tpu_devices(num_slices=SLICES)))


def test_two_slice_state_and_batch_shardings():
  """Without compiling (the compiled program's DCN traffic is the slow test below): each
  slice holds the whole train state (every parameter and optimizer array, FSDP-split over
  its own 4 chips only), so a parameter gather never crosses DCN; the batch rows split over
  the slices (data over DCN: slice 0 the first 4 rows, slice 1 the last 4)."""
  prog = _two_slice_program()
  slice_of = {d: d.slice_index for d in prog.mesh.devices.flat}
  split = 0
  for x in jax.tree.leaves(prog.abstract_state):
    held = [set(), set()]   # per slice: the parts of x its chips hold
    for d, index in x.sharding.devices_indices_map(x.shape).items():
      held[slice_of[d]].add(tuple((i.start, i.stop) for i in index))
    assert held[0] == held[1], (x.shape, held)
    whole = sum(np.prod([(b or n) - (a or 0) for (a, b), n in zip(part, x.shape)])
                for part in held[0])
    assert whole == x.size, (x.shape, held)   # the parts tile the array exactly once
    split += len(held[0]) == 4
  assert split > 0   # FSDP splits the large arrays 4 ways within each slice
  batch = prog.abstract_batch()["inputs"]
  for d, (rows, _) in batch.sharding.devices_indices_map(batch.shape).items():
    assert rows.stop - rows.start == 1 and rows.start // 4 == slice_of[d], (d, rows)


@pytest.mark.slow
def test_train_step_compiles_for_two_slices_with_data_over_dcn():
  """A two-layer micro model's whole train step (a dense layer and a LatentMoE one; fsdp 4
  within each slice, data 2 across): the only DCN traffic is all-reduces (gradient sums,
  the loss); every parameter all-gather and reduce-scatter of FSDP stays within a slice
  (groups of the 4 chips of one slice), and so do the tokens: moe.dispatch="auto" sorts
  each device's own pairs ("dropless" under jit alone all-gathers every device's routing
  across the slices too)."""
  prog = _two_slice_program()
  report, compiled = memory.compile_report(prog)
  hlo = compiled.as_text()
  assert _megascale_transfers(hlo) == {"ALL_REDUCE"}
  groups = _ici_groups(hlo)
  assert groups and all(len(g) <= 4 for g in groups)
  assert report.chips == 8 and report.slices == {"data": 2} and report.fits
  assert report.argument_bytes >= memory.state_bytes_per_chip(prog)
  assert report.lines()[0].startswith("topology: 8 x TPU v5 in 2 slices, over DCN {'data': 2}")


@pytest.mark.slow
def test_kernel_train_step_compiles_for_two_slices():
  """The five-layer kernel config of test_aot (KDA and Newton-Schulz as Mosaic kernels,
  LatentMoE layers, moe.dispatch="auto") over two slices: data over DCN, fsdp 4 within
  each; only all-reduces cross the slices, and it fits a v5p chip."""
  cfg = _cfg(tiny_kernel_config(), data=2, dcn_data=2, fsdp=4)
  cfg.train.global_batch, cfg.model.moe.dispatch = 8, "auto"
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, tpu_devices(num_slices=SLICES)))
  report, compiled = memory.compile_report(prog)
  assert _megascale_transfers(compiled.as_text()) == {"ALL_REDUCE"}
  assert report.slices == {"data": 2} and report.fits and report.flops_per_chip > 0


def _aot_cli(*flags, timeout):
  tpu_devices()  # skips where libtpu is missing
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "k3jax.aot", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_aot_cli_names_the_slices_and_refuses_k3_full_before_compiling():
  """`--num_slices=2`: the topology line says which axes cross the slices; k3_full's state
  does not fit 8 chips, which is said before any compile (exit 1)."""
  proc = _aot_cli("--config=experiments/k3_full.py", "--topology=v5p:2x2x1", "--num_slices=2",
                  "--config.mesh.dcn_data=2", timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert ("topology v5p:2x2x1: 8 chips in 2 slices, over DCN {'data': 2}, mesh {'data': 8, "
          "'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}") in proc.stdout
  assert "DOES NOT FIT: the train state alone needs" in proc.stdout


@pytest.mark.slow
def test_aot_cli_compiles_k3_tiny_for_two_slices():
  """`python -m k3jax.aot --num_slices=2`: k3_tiny over two v5p slices, data across them
  (compiled in 1,173 s on this loaded 2-core machine, 0.64 GiB per chip)."""
  proc = _aot_cli("--config=experiments/k3_tiny.py", "--topology=v5p:2x2x1", "--num_slices=2",
                  "--config.mesh.data=2", "--config.mesh.dcn_data=2", "--config.mesh.fsdp=4",
                  timeout=2400)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert "topology v5p:2x2x1: 8 chips in 2 slices, over DCN {'data': 2}" in out
  assert "topology: 8 x TPU v5 in 2 slices, over DCN {'data': 2}" in out
  assert re.search(r"HBM per chip: total [\d.]+ GiB of 95.00 GiB", out) and out.endswith("fits\n")

"""Checkpointer: roundtrip, retention, finalized-only steps, its error messages, and the
checksums that keep damaged arrays from loading."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax import checkpoint as k3ckpt
from k3jax import checksums as k3checksums
from k3jax.checkpoint import Checkpointer
from k3jax.config import base_config
from k3jax.model.layers import Dense


def _state():
  return {
      "step": 7,                                        # a Python int
      "opt_count": jnp.int32(3),
      "params": {"emb": jnp.arange(8, dtype=jnp.bfloat16).reshape(4, 2) / 3,
                 "w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3),
                 "rows": jnp.arange(24, dtype=jnp.float32).reshape(8, 3)},  # sharded
      "model": nnx.state(nnx.Linear(2, 4, rngs=nnx.Rngs(0))),   # Variables, as nnx gives
  }


def _abstract(state, mesh):
  def leaf(x):
    x = jnp.asarray(x)
    spec = P("d") if x.ndim and x.shape[0] % mesh.size == 0 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(leaf, state)


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()), ("d",))


def test_roundtrip(tmp_path, mesh):
  state = _state()
  data_state = {"next_index": 12, "epoch": np.int64(1), "parents": [{"a": 1}]}
  config_json = base_config().to_json()
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(7, state, data_state, config_json)
    ckpt.save(8, state, b'{"raw": "grain bytes state"}')
    ckpt.wait()
    assert ckpt.latest_step() == 8

    target = _abstract(state, mesh)
    restored, restored_data = ckpt.restore(7, target)
    assert restored_data == {"next_index": 12, "epoch": 1, "parents": [{"a": 1}]}
    assert json.loads(ckpt.restore_config(7)) == json.loads(config_json)
    assert ckpt.restore_config(8) is None
    assert ckpt.restore(8, target)[1] == b'{"raw": "grain bytes state"}'

  want = jax.tree.map(np.asarray, state)
  got = jax.tree.map(np.asarray, restored)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(want)):
    assert g.dtype == np.asarray(w).dtype or path[-1].key == "step", path
    np.testing.assert_array_equal(g, w, err_msg=str(path))
  assert restored["params"]["emb"].dtype == jnp.bfloat16
  assert isinstance(restored["model"], nnx.State)
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert r.sharding == t.sharding
  assert restored["params"]["rows"].sharding.spec == P("d")   # split over the mesh


def test_keep_last_n_and_interval(tmp_path):
  state = {"w": jnp.ones((2, 2))}
  with Checkpointer(tmp_path, keep=2, save_every=2) as ckpt:
    saved = [ckpt.save(s, state) for s in range(1, 7)]
    assert saved == [False, True, False, True, False, True]
    assert ckpt.save(7, state, force=True)
    assert not ckpt.save(7, state, force=True)   # already saved: skipped
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
  assert sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == ["6", "7"]


def test_only_finalized_steps(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, {"w": jnp.ones(3)})
  # A save that died before finalization leaves a temporary directory behind.
  tmp = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000000000"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "junk").write_text("partial")
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    with pytest.raises(FileNotFoundError, match="step 2"):
      ckpt.restore(2, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(OSError, match="a_file/run/checkpoints.*not writable"):
    Checkpointer(blocker / "run")


def test_shape_mismatch_names_the_path(tmp_path, mesh):
  state = _state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    ckpt.wait()
    target = _abstract(state, mesh)
    target["params"]["w"] = jax.ShapeDtypeStruct((3, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"params/w: stored \(2, 3\), target \(3, 3\)"):
      ckpt.restore(1, target)
    del target["params"]["emb"]
    with pytest.raises(ValueError, match=r"params/emb: in the checkpoint"):
      ckpt.restore(1, target)


class _Tiny(nnx.Module):
  def __init__(self, rngs):
    self.dense = Dense(4, 8, ("embed", "mlp"), rngs=rngs)   # Muon
    self.emb = nnx.Param(jnp.ones((3, 4)))                  # AdamW
    self.norm = nnx.Param(jnp.ones((8,)))
    self.bias_state = nnx.BatchStat(jnp.zeros((8,)))   # non-trainable state


def test_train_state_tuple_with_optimizer_state(tmp_path, mesh):
  """The trainer's layout: (params, rest, opt_state) with Variables and optax namedtuples
  (the default optimizer: Muon and AdamW partitions, masked nodes included)."""
  from k3jax.optim import make_optimizer

  cfg = base_config()
  cfg.train.steps, cfg.optimizer.warmup_steps = 10, 2
  model = _Tiny(nnx.Rngs(0))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  tx, _ = make_optimizer(cfg, params)
  opt_state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = jax.tree.map(lambda p, u: p + u, params, updates)
  state = (params, rest, opt_state)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, force=True)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())), state)
    restored, _ = ckpt.restore(1, target)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(r), np.asarray(s))


def test_keep_last_n_and_every_k(tmp_path):
  """keep=2, keep_every=4: the two newest steps survive, and every multiple of 4 for good
  (also across a reopened Checkpointer); a keep_every that no saved step can hit is refused."""
  state = {"w": jnp.ones((2, 2))}
  with Checkpointer(tmp_path, keep=2, keep_every=4, save_every=2) as ckpt:
    assert [s for s in range(1, 13) if ckpt.save(s, state)] == [2, 4, 6, 8, 10, 12]
    assert ckpt.save(13, state, force=True)   # a preemption's off-interval save
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 12, 13]
  with Checkpointer(tmp_path, keep=2, keep_every=4, save_every=2) as ckpt:
    ckpt.save(14, state)
    ckpt.save(16, state)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 12, 14, 16]
  assert sorted(int(p) for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == [
      4, 8, 12, 14, 16]
  with pytest.raises(ValueError, match="keep_every=5 is not a multiple of save_every=2"):
    Checkpointer(tmp_path, keep_every=5, save_every=2)



def test_compression_is_optional_and_either_reads_either(tmp_path):
  """compress=False writes the arrays as they are (1 MiB of zeros stays 1 MiB; zstd makes
  it a few KiB), and a Checkpointer of either setting restores a checkpoint of the other."""
  state = {"zeros": jnp.zeros((256, 1024)), "w": jnp.linspace(-1, 1, 4096).reshape(64, 64)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  size = {}
  for compress in (True, False):
    with Checkpointer(tmp_path / str(compress), compress=compress) as ckpt:
      ckpt.save(1, state, force=True)
    files = (tmp_path / str(compress) / "checkpoints" / "1").rglob("*")
    size[compress] = sum(f.stat().st_size for f in files if f.is_file())
  assert size[False] > 2**20 > 20 * size[True], size
  for compress in (True, False):
    with Checkpointer(tmp_path / str(compress), compress=not compress) as ckpt:
      restored, _ = ckpt.restore(1, target)
    for k in state:
      np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(state[k]))

# --- integrity: every array checked against its checksum recorded at save ---------------

def _train_state(step):
  """A trainer-like state whose every array depends on `step`: weights, Muon momentum
  (random: it compresses to a data file of its own rather than inline), a counter."""
  rng = np.random.default_rng(step)
  return {"params": {"w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)},
          "muon_momentum": jnp.asarray(rng.standard_normal((32, 32)), jnp.float32),
          "count": jnp.int32(step)}


def _three_steps(tmp_path, compress=False):
  """Steps 1, 2, 3 of `_train_state` saved; (checkpoints dir, restore target)."""
  with Checkpointer(tmp_path, keep=0, compress=compress) as ckpt:
    for s in (1, 2, 3):
      ckpt.save(s, _train_state(s), force=True)
  return tmp_path / "checkpoints", jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _train_state(0))


def _falls_back_to_step_2(tmp_path, target, caplog, array, file):
  """restore_latest gives step 2's values, step 3 moved aside, a warning naming `array` and
  its `file`; `restore(3)` raises DamagedCheckpoint naming them too."""
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(k3ckpt.DamagedCheckpoint, match=f"{array} \\({file}\\)"):
      ckpt.restore(3, target)
    got = ckpt.restore_latest(target)
    assert got.step == 2 and ckpt.all_steps() == [1, 2]
  for g, w in zip(jax.tree.leaves(got.state), jax.tree.leaves(_train_state(2))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert (tmp_path / "checkpoints" / "3.corrupt").is_dir()
  warning = caplog.text
  assert "step 3 (" in warning and "checksums recorded at save" in warning, warning
  assert f"{array} ({file})" in warning and "restored step 2" in warning, warning


def test_zeroed_array_file_is_moved_aside_and_the_previous_step_restored(tmp_path, caplog):
  """The issue's case: the data file holding the newest step's Muon momentum overwritten
  with zeros at its size (train.checkpoint_compression=False, the trainer's default: the
  file reads back as zeros without an error)."""
  root, target = _three_steps(tmp_path)
  file, _, _ = k3checksums.array_locations(root / "3")["muon_momentum"][0]
  path = root / "3" / file
  path.write_bytes(bytes(path.stat().st_size))
  _falls_back_to_step_2(tmp_path, target, caplog, "muon_momentum", file)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
def test_eight_flipped_bytes_in_an_array_file_are_caught(tmp_path, caplog, compress):
  """8 bytes of the momentum's data inverted in place: raw, the values change; zstd-
  compressed, they decompress without an error into other values. Either way step 3 is
  moved aside and step 2 restored."""
  root, target = _three_steps(tmp_path, compress)
  file, offset, length = k3checksums.array_locations(root / "3")["muon_momentum"][0]
  path = root / "3" / file
  data = bytearray(path.read_bytes())
  for i in range(8):
    data[offset + length // 3 + 97 * i] ^= 0xFF
  path.write_bytes(bytes(data))
  _falls_back_to_step_2(tmp_path, target, caplog, "muon_momentum", file)


def test_checksums_are_of_the_global_array_whatever_the_sharding(tmp_path):
  """The same values saved from one device, split over 8 along rows, over a 2 x 4 mesh along
  rows and columns, and replicated: the same recorded checksums, equal to the on-device
  computation (XLA, used off CPU) of each layout; another value, another checksum."""
  rng = np.random.default_rng(0)
  values = {"f32": rng.standard_normal((8, 12)).astype(np.float32),
            "bf16": rng.standard_normal((16, 8)).astype(jnp.bfloat16),
            "i8": rng.integers(-9, 9, (8, 4)).astype(np.int8),
            "mask": rng.integers(0, 2, (8, 8)).astype(bool),
            "vector": rng.standard_normal(16).astype(np.float32), "scalar": np.float32(3.5)}
  devices = np.array(jax.devices())
  line, grid = Mesh(devices, ("d",)), Mesh(devices.reshape(2, 4), ("a", "b"))
  layouts = {   # sharding by rank (scalars on one device)
      "one device": lambda ndim: jax.sharding.SingleDeviceSharding(devices[0]),
      "rows over 8": lambda ndim: NamedSharding(line, P("d")),
      "2 x 4, rows and columns": lambda ndim: NamedSharding(
          grid, P("a", "b") if ndim == 2 else P(("a", "b"))),
      "replicated": lambda ndim: NamedSharding(line, P())}
  recorded = {}
  for name, sharding in layouts.items():
    state = {k: jax.device_put(v, sharding(v.ndim) if v.ndim else devices[0])
             for k, v in values.items()}
    with Checkpointer(tmp_path / name.replace(" ", "_")) as ckpt:
      ckpt.save(1, state, force=True)
      ckpt.wait()
      recorded[name] = json.loads((ckpt.directory / "1" / "checksums" / "metadata")
                                  .read_text())
    arrays = tuple(v for k, v in state.items() if k != "scalar")   # on one device set
    on_device = (k3checksums._device_checksums(arrays)
                 + k3checksums._device_checksums((state["scalar"],)))
    assert [int(s) for s in on_device] == [
        recorded[name]["arrays"][k]["checksum"] for k in state], name
  want = recorded["one device"]
  assert want["format"] == k3checksums.CHECKSUM_FORMAT and sorted(want["arrays"]) == sorted(values)
  assert (want["arrays"]["bf16"]["dtype"], want["arrays"]["bf16"]["shape"]) == ("bfloat16",
                                                                               [16, 8])
  for name, got in recorded.items():
    assert got == want, name
  changed = values["f32"].copy()
  changed[3, 5] = np.nextafter(changed[3, 5], np.inf)
  assert k3checksums.checksums({"f32": changed})["f32"] != want["arrays"]["f32"]


def test_checksum_sees_zeros_flipped_bytes_and_swaps():
  """The faults a checksum exists for change it: a zeroed row, two rows swapped, two elements
  of a row swapped, one inverted byte (each byte of a row in turn)."""
  x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)

  def checksum(a):
    return k3checksums.checksums({"x": a})["x"]["checksum"]

  base = checksum(x)
  damaged = [x.copy() for _ in range(3)]
  damaged[0][2] = 0
  damaged[1][[1, 4]] = x[[4, 1]]
  damaged[2][3, [0, 7]] = x[3, [7, 0]]
  for i in range(x.shape[1] * 4):
    flipped = x.copy()
    flipped[5].view(np.uint8)[i] ^= 0xFF
    damaged.append(flipped)
  assert all(checksum(d) != base for d in damaged)


def test_a_step_saved_without_checksums_restores_unverified(tmp_path):
  """Steps written before checksums existed (no `checksums` item; `checksums=False` writes
  them) restore as they are."""
  with Checkpointer(tmp_path, checksums=False) as ckpt:
    ckpt.save(4, _train_state(4), force=True)
  assert not (tmp_path / "checkpoints" / "4" / "checksums").exists()
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _train_state(0))
  with Checkpointer(tmp_path) as ckpt:
    got = ckpt.restore_latest(target)
  assert got.step == 4
  for g, w in zip(jax.tree.leaves(got.state), jax.tree.leaves(_train_state(4))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

# --- the data iterator under another process count ----------------------------------------

def test_data_iterator_state_resumes_under_another_process_count(tmp_path):
  """The iterator state saved as process 0 of 1, restored as processes 0..n-1 of n (n = 2,
  4): the rows each reads, concatenated, are the rows the one process reads next; a process
  count that does not divide the global batch is refused, naming both."""
  from k3jax.data import make_dataset

  data_cfg = base_config().data

  def dataset(index, count):
    return make_dataset(data_cfg, seq_len=32, global_batch=4, seed=0, process_index=index,
                        process_count=count)

  one = iter(dataset(0, 1))
  for _ in range(3):
    next(one)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, {"w": jnp.ones(2)}, one.get_state(), force=True)
    want = [next(one) for _ in range(3)]
    _, data_state = ckpt.restore(3, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
  for count in (2, 4):
    got = []
    for index in range(count):
      it = iter(dataset(index, count))
      it.set_state(data_state)
      got.append([next(it) for _ in range(3)])
    for b, w in enumerate(want):
      for k in w:
        assert all(g[b][k].shape[0] == 4 // count for g in got)
        np.testing.assert_array_equal(np.concatenate([g[b][k] for g in got]), w[k],
                                      err_msg=f"{count} processes, batch {b}, {k}")
  with pytest.raises(ValueError, match=r"global_batch=4.*process_count=3"):
    dataset(0, 3)


# --- restore onto another mesh / device count -------------------------------------------

def _mesh_program(cfg, **sizes):
  """The training program of `cfg` on a mesh of `sizes` over the first prod(sizes) devices
  (a run on fewer devices than the host has)."""
  from k3jax import parallel, program

  for axis in parallel.MESH_AXES:
    cfg.mesh[axis] = sizes.get(axis, 1)
  return program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(
      list(sizes.values())))]))


def _reshard_config(**changes):
  from conftest import micro_config

  c = micro_config()
  c.train.global_batch = 8                  # one row per device of the fsdp=8 mesh
  c.optimizer.muon.ns_dtype = "float32"     # fp32 throughout: nothing rounds to bf16
  for k, v in changes.items():
    c.model[k] = v
  return c


def test_state_saved_on_8_devices_restores_onto_4_with_another_mesh(tmp_path):
  """The training program's whole state (Muon + AdamW optimizer state, balancing biases),
  saved from fsdp=8 over 8 devices, restored for data=2 x fsdp=2 over 4 of them: every
  array bit-equal, in the new program's sharding, on those 4 devices only. 4 layers (the
  KDA x3 + MLA cycle with dense and MoE FFNs): the 13-layer program builds 3x slower."""
  from k3jax.config import RESTORE_FIELDS

  prog8 = _mesh_program(_reshard_config(num_layers=4), fsdp=8)
  prog4 = _mesh_program(_reshard_config(num_layers=4), data=2, fsdp=2)
  rng = np.random.default_rng(0)
  values = [rng.standard_normal(x.shape).astype(x.dtype) for x in
            jax.tree.leaves(prog8.abstract_state)]   # numpy: no XLA init compile
  state = jax.tree.unflatten(jax.tree.structure(prog8.abstract_state), [
      jax.device_put(v, x.sharding) for v, x in zip(values, jax.tree.leaves(
          prog8.abstract_state))])
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, state, config_json=prog8.cfg.to_json(), force=True)
    got = ckpt.restore_latest(prog4.abstract_state, config_json=prog4.cfg.to_json(),
                              must_match=RESTORE_FIELDS)
  assert got.step == 5
  assert jax.tree.structure(got.state) == jax.tree.structure(prog4.abstract_state)
  four = set(jax.devices()[:4])
  for (path, r), t, v in zip(jax.tree_util.tree_flatten_with_path(got.state)[0],
                             jax.tree.leaves(prog4.abstract_state), values):
    assert r.sharding == t.sharding and r.sharding.device_set == four, path
    np.testing.assert_array_equal(np.asarray(r), v, err_msg=jax.tree_util.keystr(path))


def _start_state(prog):
  """A well-conditioned random point (as tests/test_parallel.py's: matrices at a quarter of
  random_model's scale, AttnRes queries at zero, balancing biases a score apart so top-k
  picks do not flip on reduction-order noise) and a fresh optimizer state, placed on the
  program's shardings (numpy values: no XLA init compile)."""
  from conftest import random_model

  _, params, rest = nnx.split(random_model(prog.cfg.model), nnx.Param, ...)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (0 * x if "query" in jax.tree_util.keystr(path) else
                       0.25 * x if x.ndim >= 2 and "embed" not in jax.tree_util.keystr(path)
                       else x), nnx.as_pure(params))
  rest = jax.tree.map(lambda b: np.broadcast_to(np.arange(b.shape[-1], dtype=b.dtype), b.shape)
                      if b.ndim >= 1 else b, nnx.as_pure(rest))
  return jax.device_put((params, rest, prog.tx.init(params)), prog.state_shardings)


def _batch(prog, step):
  """The global batch of `step`: random tokens, two documents per row."""
  t = prog.cfg.train
  rng = np.random.default_rng(step)
  tokens = rng.integers(1, prog.cfg.model.vocab_size, (t.global_batch, t.seq_len + 1))
  half = t.seq_len // 2
  seg = np.repeat([[1] * half + [2] * (t.seq_len - half)], t.global_batch, 0)
  pos = np.concatenate([np.arange(half), np.arange(t.seq_len - half)])
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
           "positions": np.broadcast_to(pos, seg.shape), "weights": np.ones(seg.shape)}
  want = prog.abstract_batch()
  return {k: jax.device_put(np.asarray(v, want[k].dtype), want[k].sharding)
          for k, v in batch.items()}


def _run(prog, state, steps):
  """(`state` after the train steps `steps`, [each step's loss])."""
  losses = []
  with prog.rules():
    for s in steps:
      *state, out = prog.train_step(*state, _batch(prog, s))
      losses.append(float(out["loss"]))
  return tuple(state), losses


@pytest.mark.slow
def test_restored_on_another_mesh_the_next_steps_equal_the_uninterrupted_run(tmp_path):
  """A step taken on fsdp=8 over 8 devices and saved; restored onto data=2 x fsdp=2 over 4
  of them, the next two steps' losses and the parameters after them equal those of the run
  that went on on the original mesh, to fp32 reduction-order noise (the meshes sum in
  different orders). 4 layers (a KDA x3 + MLA cycle, dense and MoE FFNs): two train-step
  compiles take minutes on 2 cores."""
  from k3jax.config import RESTORE_FIELDS

  prog8 = _mesh_program(_reshard_config(num_layers=4), fsdp=8)
  state, _ = _run(prog8, _start_state(prog8), [1])
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, config_json=prog8.cfg.to_json(), force=True)
    went_on, want = _run(prog8, state, [2, 3])
    prog4 = _mesh_program(_reshard_config(num_layers=4), data=2, fsdp=2)
    got = ckpt.restore_latest(prog4.abstract_state, config_json=prog4.cfg.to_json(),
                              must_match=RESTORE_FIELDS)
  assert got.step == 1
  resumed, losses = _run(prog4, got.state, [2, 3])
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(resumed)[0],
                          jax.tree.leaves(went_on)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))

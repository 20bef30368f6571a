"""Checkpointer: roundtrip, retention, finalized-only steps, and its error messages."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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

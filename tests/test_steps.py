"""The train step: microbatched (gradient accumulation) vs the whole batch at once."""

import jax
import numpy as np
import pytest
from conftest import micro_config

from k3jax import config as k3config
from k3jax import parallel, program


def _batch(cfg, seed=0):
  """Two documents per row in places, and padding, so that microbatches hold different
  token counts and the loss denominator matters."""
  t = cfg.train
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1))
  seg = np.ones((t.global_batch, t.seq_len), np.int32)
  seg[::2, t.seq_len // 3:] = 2
  for r in range(t.global_batch):
    seg[r, t.seq_len - 3 * r:] = 0  # row r ends with 3r padding tokens
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "segment_ids": seg, "positions": np.zeros_like(seg),
          "weights": (seg > 0).astype(np.float32)}


def _one_step(microbatches):
  """One train step and an eval of the new state. 5 layers: one scanned [KDA x 3, MLA]
  cycle and the final MLA, all MoE, so that aux of both layer groups is merged; AdamW,
  the cheaper compile (the gradient is compared through out["grad_norm"], the update
  through the parameters and optimizer state)."""
  cfg = micro_config()
  cfg.model.num_layers, cfg.model.dense_layers = 5, 0
  cfg.optimizer.name = "adamw"
  cfg.train.global_batch, cfg.train.microbatches = 8, microbatches
  cfg.mesh.data = 4
  k3config.validate(cfg)
  mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:4])
  prog = program.build(cfg, mesh)
  batch = jax.device_put(_batch(cfg), prog.batch_sharding)
  with prog.rules():
    state = prog.init()
    *state, out = prog.train_step(*state, batch)
    eval_loss = prog.eval_step(state[0], state[1], batch)
  return jax.device_get((state, out, eval_loss))


@pytest.fixture(scope="module")
def whole():
  return _one_step(1)


def test_microbatched_step_equals_whole_batch(whole):
  """2 microbatches of 4 rows on a 4-way data-parallel mesh: the same loss, load
  statistics, max logits, updated parameters, optimizer state and Quantile-Balancing
  biases as the 8 rows at once (fp32)."""
  (state, out, eval_loss) = _one_step(2)
  (ref_state, ref_out, ref_eval) = whole
  assert set(out) == set(ref_out)
  for k in out:
    np.testing.assert_allclose(out[k], ref_out[k], rtol=2e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(eval_loss, ref_eval, rtol=1e-6)
  flat, ref_flat = jax.tree.leaves_with_path(state), jax.tree.leaves(ref_state)
  for (path, x), y in zip(flat, ref_flat, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_microbatches_must_split_the_batch_over_devices():
  cfg = micro_config()
  cfg.train.global_batch, cfg.train.microbatches = 6, 4
  with pytest.raises(k3config.ConfigError, match="train.microbatches"):
    k3config.validate(cfg)
  cfg.train.global_batch, cfg.train.microbatches, cfg.mesh.data = 8, 4, 4
  mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:4])
  with pytest.raises(k3config.ConfigError, match="do not each split over the 4"):
    program.build(k3config.validate(cfg), mesh)

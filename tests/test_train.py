"""The trainer end to end on the micro config: it learns, and a resumed run equals an
uninterrupted one."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import micro_config
from flax import nnx

from k3jax import config as k3config
from k3jax import train as k3train


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  params, rest = k3train.train(train_config(), workdir)
  return workdir, params, rest


def test_loss_falls(uninterrupted):
  workdir, _, _ = uninterrupted
  got = losses(workdir)
  assert sorted(got) == list(range(1, 13))
  assert got[12] < got[1] - 0.5, got


def test_resumed_run_equals_uninterrupted(uninterrupted, tmp_path):
  workdir, params, rest = uninterrupted
  resumed = str(tmp_path)
  k3train.train(train_config(), resumed, stop_after=5)  # stops at step 5, saved there
  assert sorted(losses(resumed)) == list(range(1, 6))
  params2, rest2 = k3train.train(train_config(), resumed)  # the same command again
  got, want = losses(resumed), losses(workdir)
  assert [got[s] for s in range(6, 13)] == [want[s] for s in range(6, 13)]
  for (path, a), (_, b) in zip(nnx.to_flat_state(params2), nnx.to_flat_state(params)):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
  jax.tree.map(np.testing.assert_array_equal, rest2, rest)  # Quantile-Balancing biases


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
  c = train_config()
  c.model.vocab_size = 100
  with pytest.raises(k3config.ConfigError, match="vocab_size"):
    k3train.train(c, str(tmp_path))

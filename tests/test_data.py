"""Tests of k3jax.data: tokenizer, embedded corpus, grain pipeline."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from pydoc_data import topics

from k3jax import data

SEQ = 128
BATCH = 4
PACKINGS = data.PACKINGS
TOK = data.ByteTokenizer()


def _cfg(packing="first_fit", worker_count=0):
  cfg = data.data_config()
  cfg.packing = packing
  cfg.worker_count = worker_count
  return cfg


def _take(ds, n):
  it = iter(ds)
  return [next(it) for _ in range(n)]


def _segments(batch):
  """Yield (inputs, targets, positions) of every segment of every row."""
  for r in range(batch["segment_ids"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      m = seg == s
      yield batch["inputs"][r][m], batch["targets"][r][m], batch["positions"][r][m]


def _key(inputs, targets):
  return tuple(inputs.tolist()) + (int(targets[-1]),)


def _as_text(tokens):
  return "".join(map(chr, tokens))


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_roundtrip():
  assert (TOK.bos, TOK.eos, TOK.vocab_size) == (256, 257, 258)
  for text in ["", "hello", "héllo ∑ 🙂\n\ttabs", topics.topics["assert"]]:
    ids = TOK.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text.encode("utf-8")),)
    assert TOK.decode(ids) == text
  ids = np.concatenate([[TOK.bos], TOK.encode("ab"), [TOK.eos]])
  assert TOK.decode(ids) == "ab"
  assert TOK.decode(TOK.encode("é")[:1]) == "\ufffd"


# --- corpus ----------------------------------------------------------------------------------


def test_splits_disjoint_and_complete():
  train = data.default_documents("train")
  heldout = data.default_documents("validation")
  assert heldout and len(train) > 10 * len(heldout)
  assert not set(train) & set(heldout)
  assert sorted(train + heldout) == sorted(topics.topics.values())
  assert train == data.default_documents("train")
  with pytest.raises(ValueError, match="split"):
    data.default_documents("test")


def test_unigram_entropy():
  assert math.isclose(data.unigram_entropy(["ab"], TOK), math.log(3))  # a, b, eos
  h = data.unigram_entropy(data.default_documents("train"), TOK)
  assert 3.0 < h < 3.5


# --- pipeline --------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", PACKINGS)
def test_shapes_and_dtypes(packing):
  for b in _take(data.make_dataset(_cfg(packing), seq_len=SEQ, global_batch=BATCH, seed=0), 3):
    assert set(b) == set(data.FEATURES)
    for k in ("inputs", "targets", "segment_ids", "positions"):
      assert b[k].shape == (BATCH, SEQ) and b[k].dtype == np.int32, k
    assert b["weights"].shape == (BATCH, SEQ) and b["weights"].dtype == np.float32


def _assert_rows_are_packed_documents(b):
  """segment ids 1, 2, ... in order, padding (0) only at a row's end, positions from 0 in
  each segment, targets the next input within a segment, weights on real tokens."""
  seg, pos = b["segment_ids"], b["positions"]
  np.testing.assert_array_equal(b["weights"], (seg > 0).astype(np.float32))
  for r in range(seg.shape[0]):
    s, p = seg[r], pos[r]
    n = int((s > 0).sum())
    assert s[0] == 1 and np.all(s[n:] == 0)              # padding only at the row end
    assert set(np.diff(s[:n]).tolist()) <= {0, 1}         # segments 1, 2, ... in order
    assert np.all(b["inputs"][r][n:] == 0) and np.all(b["targets"][r][n:] == 0)
    assert np.all(p[n:] == 0)
    starts = np.concatenate([[True], s[1:n] != s[:n - 1]])
    assert np.all(p[:n][starts] == 0)
    assert np.all(p[1:n][~starts[1:]] == p[:n - 1][~starts[1:]] + 1)
    same = (s[1:] == s[:-1]) & (s[1:] > 0)
    np.testing.assert_array_equal(b["inputs"][r][1:][same], b["targets"][r][:-1][same])


@pytest.mark.parametrize("packing", PACKINGS)
def test_row_invariants(packing):
  for b in _take(data.make_dataset(_cfg(packing), seq_len=SEQ, global_batch=BATCH, seed=1), 8):
    _assert_rows_are_packed_documents(b)
    assert np.all(b["targets"][b["segment_ids"] > 0] != TOK.bos)


@pytest.mark.parametrize("documents", [1, 3, 64])
def test_synthetic_batch_is_shaped_like_the_pipeline(documents):
  """The random-token batch that benchmarks time: the pipeline's features, shapes, dtypes and
  row invariants, `documents` segments a row."""
  b = data.synthetic_batch(BATCH, 64, 300, documents=documents)
  assert sorted(b) == sorted(data.FEATURES)
  for k, v in b.items():
    assert v.shape == (BATCH, 64) and v.dtype == (np.float32 if k == "weights" else np.int32)
  _assert_rows_are_packed_documents(b)
  assert b["segment_ids"].max() == documents and b["inputs"].max() < 300
  with pytest.raises(ValueError, match="documents"):
    data.synthetic_batch(BATCH, 64, 300, documents=65)


def test_first_fit_rows_hold_whole_pieces():
  seq = 1024
  pieces = {_key(p["inputs"], p["targets"])
            for p in data.document_pieces(data.default_documents("train"), TOK, seq)}
  ds = data.make_dataset(_cfg("first_fit"), seq_len=seq, global_batch=BATCH, seed=2)
  shared_rows = 0
  for b in _take(ds, 8):
    for inputs, targets, _ in _segments(b):
      assert _key(inputs, targets) in pieces
    shared_rows += int((b["segment_ids"].max(axis=1) > 1).sum())
  assert shared_rows > 0  # some rows hold several pieces


def test_concat_then_split_rows_hold_contiguous_text():
  docs = data.default_documents("train")
  corpus = "\x00".join(_as_text([TOK.bos, *TOK.encode(d), TOK.eos]) for d in docs)
  ds = data.make_dataset(_cfg("concat_then_split"), seq_len=SEQ, global_batch=BATCH, seed=2)
  for b in _take(ds, 8):
    assert b["weights"].min() == 1.0  # no padding in an endless stream
    for inputs, targets, _ in _segments(b):
      assert _as_text(_key(inputs, targets)) in corpus


@pytest.mark.parametrize("packing", PACKINGS)
def test_whole_documents_decode_to_source(packing):
  docs = set(data.default_documents("train"))
  ds = data.make_dataset(_cfg(packing), seq_len=4096, global_batch=BATCH, seed=3)
  found = 0
  for b in _take(ds, 4):
    for inputs, targets, _ in _segments(b):
      if inputs[0] == TOK.bos and targets[-1] == TOK.eos:
        assert TOK.decode(np.concatenate([inputs, targets[-1:]])) in docs
        found += 1
  assert found >= 2


@pytest.mark.parametrize("packing", PACKINGS)
def test_seed_determinism(packing):
  make = lambda seed: _take(data.make_dataset(_cfg(packing), seq_len=SEQ, global_batch=BATCH,
                                              seed=seed), 3)
  a, b, c = make(7), make(7), make(8)
  for x, y in zip(a, b):
    for k in data.FEATURES:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))


def test_epochs_are_reshuffled():
  ds = data.piece_dataset(_cfg(), seq_len=SEQ, seed=0, split="validation")
  n = len(data.document_pieces(data.default_documents("validation"), TOK, SEQ))
  first = [_key(ds[i]["inputs"], ds[i]["targets"]) for i in range(n)]
  second = [_key(ds[i]["inputs"], ds[i]["targets"]) for i in range(n, 2 * n)]
  assert first != second and sorted(first) == sorted(second)


@pytest.mark.parametrize("packing", PACKINGS)
def test_processes_split_the_one_process_batches(packing):
  # Process p of n holds rows [p * 8 / n, (p + 1) * 8 / n) of the one-process batch, for
  # every n: runs under any process count see the same global batches, and their iterators
  # are at the same position (what the checkpoint stores for all of them).
  make = lambda p, n: iter(data.make_dataset(_cfg(packing), seq_len=SEQ, global_batch=8,
                                             seed=5, process_index=p, process_count=n))
  whole = make(0, 1)
  shards = {n: [make(p, n) for p in range(n)] for n in (2, 4)}
  for _ in range(3):
    want = next(whole)
    for n, its in shards.items():
      got = [next(it) for it in its]
      for k in data.FEATURES:
        np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k],
                                      err_msg=f"{k}, {n} processes")
      assert all(it.get_state() == whole.get_state() for it in its)


@pytest.mark.parametrize("packing", PACKINGS)
def test_iterator_state_restores_exactly(packing):
  make = lambda: data.make_dataset(_cfg(packing), seq_len=SEQ, global_batch=BATCH, seed=4,
                                   process_index=1, process_count=2)
  for skip in (0, 3, 5):
    it = iter(make())
    for _ in range(skip):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    restored = iter(make())
    next(restored)  # a used iterator must be fully overwritten by set_state
    restored.set_state(state)
    for x, y in zip(expected, [next(restored) for _ in range(4)]):
      for k in data.FEATURES:
        np.testing.assert_array_equal(x[k], y[k])


# worker_count > 0: grain worker processes read the pieces; each start (spawn, import
# grain) costs a few seconds, so these tests start as few as they can.
def _state_equal(a, b):
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("packing", PACKINGS)
def test_worker_processes_give_the_in_process_batches(packing):
  # 20 batches of 8 rows: > 100 pieces, several chunks per worker, so both workers serve
  # some; batches and iterator states are those of worker_count=0 at every step.
  make = lambda workers: iter(data.make_dataset(_cfg(packing, workers), seq_len=SEQ,
                                                global_batch=8, seed=6))
  alone, workers = make(0), make(2)
  for i in range(20):
    want, got = next(alone), next(workers)
    for k in data.FEATURES:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, batch {i}")
    assert _state_equal(workers.get_state(), alone.get_state()), i
  assert workers.get_state() != make(0).get_state()  # it moved
  workers.close()


@pytest.mark.parametrize("packing", PACKINGS)
def test_worker_iterator_state_restores_exactly(packing):
  make = lambda workers: iter(data.make_dataset(_cfg(packing, workers), seq_len=SEQ,
                                                global_batch=BATCH, seed=4))
  it = make(2)
  for _ in range(9):  # ~36 pieces: the state falls inside the second chunk
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(4)]
  it.close()
  restored = make(2)
  next(restored)  # running workers must be replaced, at the restored position
  restored.set_state(state)
  elsewhere = make(0)  # the state does not depend on the worker count
  elsewhere.set_state(state)
  for i, (x, y, z) in enumerate(zip(expected, [next(restored) for _ in range(4)],
                                    [next(elsewhere) for _ in range(4)])):
    for k in data.FEATURES:
      np.testing.assert_array_equal(y[k], x[k], err_msg=f"{k}, batch {i} (2 workers)")
      np.testing.assert_array_equal(z[k], x[k], err_msg=f"{k}, batch {i} (no workers)")
  restored.close()


_ORPHAN_CHECK = """
import multiprocessing, time
from k3jax import data

if __name__ == "__main__":
  cfg = data.data_config()
  cfg.worker_count = 2
  it = iter(data.make_dataset(cfg, seq_len=128, global_batch=4, seed=0))
  for _ in range(12):  # > 32 pieces: a chunk from each worker
    next(it)
  print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
  time.sleep(600)
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return "zombie" not in f.read()
  except FileNotFoundError:
    return False


def test_workers_exit_when_the_trainer_is_killed(tmp_path):
  # A SIGKILLed trainer cannot stop its workers; each rerun after a kill would otherwise
  # leave two more processes behind.
  script = tmp_path / "orphan_check.py"
  script.write_text(_ORPHAN_CHECK)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
       os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                          env=env)
  try:
    pids = [int(p) for p in proc.stdout.readline().split()]
  finally:
    proc.kill()
    proc.wait()
  assert len(pids) == 2, pids
  deadline = time.time() + 20
  while any(map(_alive, pids)) and time.time() < deadline:
    time.sleep(0.2)
  left = [p for p in pids if _alive(p)]
  for pid in left:  # do not leave them running when the test fails
    os.kill(pid, signal.SIGKILL)
  assert not left, f"worker processes {left} outlived their killed parent"


def test_validation_split_is_finite_and_padded():
  ds = data.make_dataset(_cfg(), seq_len=SEQ, global_batch=BATCH, seed=0,
                         split="validation", num_epochs=1)
  batches = list(ds)
  tokens = sum(b["weights"].sum() for b in batches)
  docs = data.default_documents("validation")
  assert tokens == sum(len(d.encode("utf-8")) + 1 for d in docs)
  assert all(b["inputs"].shape == (BATCH, SEQ) for b in batches)


def test_data_config_defaults():
  cfg = data.data_config()
  assert cfg.source in data.SOURCES and cfg.packing in data.PACKINGS
  data.check_config(cfg)


@pytest.mark.parametrize(
    "field, value, kwargs, match",
    [
        ("source", "c4", {}, "config.data.source"),
        ("packing", "best_fit", {}, "config.data.packing"),
        ("worker_count", -1, {}, "config.data.worker_count"),
        ("worker_buffer_size", 0, {}, "config.data.worker_buffer_size"),
        (None, None, {"global_batch": 6, "process_count": 4}, "global_batch"),
        (None, None, {"seq_len": 1}, "seq_len"),
        (None, None, {"process_index": 2, "process_count": 2}, "process_index"),
        (None, None, {"split": "test"}, "split"),
    ],
)
def test_bad_config_raises(field, value, kwargs, match):
  cfg = _cfg()
  if field:
    cfg[field] = value
  args = dict(seq_len=SEQ, global_batch=BATCH, seed=0) | kwargs
  with pytest.raises(ValueError, match=match):
    data.make_dataset(cfg, **args)

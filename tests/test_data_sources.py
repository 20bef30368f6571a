"""Document sources from local files (k3jax.data.sources) through the grain pipeline.

Files are written here, tiny; the byte tokenizer keeps the expected tokens obvious.
"""

import json
from collections import Counter

import numpy as np
import pytest

from k3jax import data

TOK = data.ByteTokenizer()
SEQ = 64


def _docs(prefix, n, rng=None):
  rng = rng or np.random.default_rng(0)
  return [f"{prefix}{i}:" + "xyz " * int(rng.integers(0, 10)) for i in range(n)]


def write_jsonl(path, docs, field="text"):
  path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
  return str(path)


def write_parquet(path, docs, column="text"):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), str(path),
                 row_group_size=7)
  return str(path)


def files_cfg(*sources, heldout_every=0, packing="first_fit"):
  cfg = data.data_config()
  cfg.source = "files"
  cfg.sources = [dict(s) for s in sources]
  cfg.heldout_every = heldout_every
  cfg.packing = packing
  return cfg


def _texts(pieces):
  """The text of each whole-document piece ([bos] ... [eos])."""
  out = []
  for i in range(len(pieces)):
    p = pieces[i]
    assert p["inputs"][0] == TOK.bos and p["targets"][-1] == TOK.eos
    out.append(TOK.decode(p["inputs"]))
  return out


def _segments(batch):
  for r in range(batch["segment_ids"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      m = seg == s
      yield batch["inputs"][r][m], batch["targets"][r][m]


def _take(ds, n):
  it = iter(ds)
  return [next(it) for _ in range(n)]


# --- formats ---------------------------------------------------------------------------------


def test_each_format_reads_its_documents_in_order(tmp_path):
  docs = _docs("d", 12)
  for i, d in enumerate(docs[:3]):
    (tmp_path / f"one_{i}.txt").write_text(d)
  (tmp_path / "many.txt").write_text("\n\n".join(docs))
  write_jsonl(tmp_path / "a.jsonl", docs, field="content")
  write_parquet(tmp_path / "a.parquet", docs, column="body")
  cases = [
      (dict(paths=str(tmp_path / "one_*.txt"), format="text"), docs[:3]),
      (dict(paths=str(tmp_path / "many.txt"), format="text", separator="\n\n"), docs),
      (dict(paths=str(tmp_path / "a.jsonl"), format="jsonl", text_field="content"), docs),
      (dict(paths=[str(tmp_path / "a.parquet")], format="parquet", column="body"), docs),
  ]
  for source, want in cases:
    [(pieces, weight)] = data.source_pieces(files_cfg(source), TOK, seq_len=SEQ, split="train")
    assert weight == 1.0 and _texts(pieces) == want, source


def test_gzip_jsonl_and_recursive_globs(tmp_path):
  import gzip
  (tmp_path / "x" / "y").mkdir(parents=True)
  docs = _docs("g", 5)
  with gzip.open(tmp_path / "x" / "y" / "a.jsonl.gz", "wt") as f:
    f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
  cfg = files_cfg(dict(paths=str(tmp_path / "**" / "*.jsonl.gz"), format="jsonl"))
  [(pieces, _)] = data.source_pieces(cfg, TOK, seq_len=SEQ, split="train")
  assert _texts(pieces) == docs


def test_long_documents_are_split_into_pieces(tmp_path):
  doc = "".join(chr(ord("a") + i % 26) for i in range(3 * SEQ + 5))
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", [doc]), format="jsonl"))
  [(pieces, _)] = data.source_pieces(cfg, TOK, seq_len=SEQ, split="train")
  assert len(pieces) == 4  # 3 * SEQ + 6 pairs
  inputs = np.concatenate([pieces[i]["inputs"] for i in range(4)])
  targets = np.concatenate([pieces[i]["targets"] for i in range(4)])
  full = np.concatenate([[TOK.bos], TOK.encode(doc), [TOK.eos]])
  np.testing.assert_array_equal(inputs, full[:-1])
  np.testing.assert_array_equal(targets, full[1:])
  assert all(len(pieces[i]["inputs"]) == SEQ for i in range(3))


# --- the pipeline over files -----------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_one_epoch_reads_every_document_once_across_processes(tmp_path, processes):
  docs = _docs("e", 40)
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", docs), format="jsonl"))
  seen = Counter()
  for p in range(processes):
    for b in data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=3, num_epochs=1,
                               process_index=p, process_count=processes):
      for inputs, targets in _segments(b):
        assert inputs[0] == TOK.bos and targets[-1] == TOK.eos
        seen[TOK.decode(inputs)] += 1
  assert seen == Counter(docs)


def test_same_seed_same_batches(tmp_path):
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", _docs("a", 30)), format="jsonl"),
                  dict(paths=write_parquet(tmp_path / "b.parquet", _docs("b", 30)),
                       format="parquet", weight=2.0))
  make = lambda seed: _take(data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=seed), 4)
  a, b, c = make(1), make(1), make(2)
  for x, y in zip(a, b):
    for k in data.FEATURES:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))


def test_mixture_weights_are_respected(tmp_path):
  cfg = files_cfg(
      dict(paths=write_jsonl(tmp_path / "a.jsonl", _docs("a", 250)), format="jsonl", weight=3.0),
      dict(paths=write_jsonl(tmp_path / "b.jsonl", _docs("b", 500)), format="jsonl", weight=1.0),
      dict(paths=write_jsonl(tmp_path / "c.jsonl", _docs("c", 400)), format="jsonl", weight=0.5))
  ds = data.piece_dataset(cfg, seq_len=SEQ, seed=0)
  n = 900
  texts = [TOK.decode(ds[i]["inputs"]) for i in range(n)]
  counts = Counter(t[0] for t in texts)
  for name, share in (("a", 3 / 4.5), ("b", 1 / 4.5), ("c", 0.5 / 4.5)):
    assert abs(counts[name] / n - share) < 0.02, (name, counts)
  # Each source repeats on its own: the first goes round twice here, reshuffled.
  a_docs = [t for t in texts if t[0] == "a"]
  assert Counter(a_docs[:250]) == Counter(a_docs[250:500]) and a_docs[:250] != a_docs[250:500]


@pytest.mark.parametrize("packing", data.PACKINGS)
def test_processes_split_the_one_process_batches(tmp_path, packing):
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", _docs("a", 30)), format="jsonl"),
                  dict(paths=write_jsonl(tmp_path / "b.jsonl", _docs("b", 30)), format="jsonl",
                       weight=0.5), packing=packing)
  make = lambda p, n: iter(data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=5,
                                             process_index=p, process_count=n))
  whole, shards = make(0, 1), [make(p, 2) for p in range(2)]
  for _ in range(3):
    want, got = next(whole), [next(it) for it in shards]
    for k in data.FEATURES:
      np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k])
    assert all(it.get_state() == whole.get_state() for it in shards)


def test_iterator_state_restores_a_mixture_exactly(tmp_path):
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", _docs("a", 20)), format="jsonl"),
                  dict(paths=write_jsonl(tmp_path / "b.jsonl", _docs("b", 20)), format="jsonl"),
                  packing="concat_then_split")
  make = lambda: data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=4)
  it = iter(make())
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  restored = iter(make())
  restored.set_state(state)
  for x, y in zip(expected, [next(restored) for _ in range(3)]):
    for k in data.FEATURES:
      np.testing.assert_array_equal(x[k], y[k])


def test_heldout_documents(tmp_path):
  docs = _docs("h", 25)
  path = write_jsonl(tmp_path / "a.jsonl", docs)
  cfg = files_cfg(dict(paths=path, format="jsonl"), heldout_every=5)
  split = {s: _texts(data.source_pieces(cfg, TOK, seq_len=SEQ, split=s)[0][0])
           for s in ("train", "validation")}
  assert split["validation"] == docs[::5]                       # documents 0, 5, 10, ...
  assert sorted(split["train"] + split["validation"]) == sorted(docs)
  held = _docs("v", 3)
  cfg = files_cfg(dict(paths=path, format="jsonl",
                       validation_paths=write_jsonl(tmp_path / "v.jsonl", held)), heldout_every=5)
  assert _texts(data.source_pieces(cfg, TOK, seq_len=SEQ, split="validation")[0][0]) == held
  assert _texts(data.source_pieces(cfg, TOK, seq_len=SEQ, split="train")[0][0]) == docs


def test_default_source_stays_the_default():
  cfg = data.data_config()
  assert (cfg.source, cfg.sources, cfg.tokenizer.kind) == ("default", (), "byte")
  from experiments.k3_tiny import get_config
  data.check_config(get_config().data)


# --- errors ----------------------------------------------------------------------------------


def _make(cfg, split="train"):
  return data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=0, split=split)


def test_glob_matching_no_file(tmp_path):
  cfg = files_cfg(dict(paths=[str(tmp_path / "*.jsonl")], format="jsonl"))
  with pytest.raises(FileNotFoundError, match=r"config.data.sources\[0\].paths: no file "
                                             r"matches '.*\*.jsonl'"):
    _make(cfg)


@pytest.mark.parametrize("fmt, name", [("text", "e.txt"), ("jsonl", "e.jsonl"),
                                       ("parquet", "e.parquet")])
def test_empty_file(tmp_path, fmt, name):
  if fmt == "parquet":
    write_parquet(tmp_path / name, [])
  else:
    (tmp_path / name).write_text("\n\n" if fmt == "jsonl" else "")
  with pytest.raises(ValueError, match=rf"{name}: empty file"):
    _make(files_cfg(dict(paths=str(tmp_path / name), format=fmt)))


def test_undecodable_bytes_name_file_and_offset(tmp_path):
  (tmp_path / "bad.txt").write_bytes(b"hello \xff world")
  with pytest.raises(ValueError, match=r"bad.txt: byte offset 6: not UTF-8"):
    _make(files_cfg(dict(paths=str(tmp_path / "bad.txt"), format="text")))
  (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "a\xc3"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: byte offset 26: not UTF-8"):
    _make(files_cfg(dict(paths=str(tmp_path / "bad.jsonl"), format="jsonl")))


def test_jsonl_errors_name_file_and_line(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text('{"text": "a"}\n\n{"body": "b"}\n')
  with pytest.raises(ValueError, match=r"a.jsonl:3: no field 'text' \(has \['body'\]\)"):
    _make(files_cfg(dict(paths=str(path), format="jsonl")))
  path.write_text('{"text": "a"}\n{"text": \n')
  with pytest.raises(ValueError, match=r"a.jsonl:2: not JSON"):
    _make(files_cfg(dict(paths=str(path), format="jsonl")))
  path.write_text('{"text": 3}\n')
  with pytest.raises(ValueError, match=r"a.jsonl:1: field 'text' is int, not text"):
    _make(files_cfg(dict(paths=str(path), format="jsonl")))


def test_parquet_without_the_column(tmp_path):
  path = write_parquet(tmp_path / "a.parquet", ["x"], column="body")
  with pytest.raises(ValueError, match=r"a.parquet: no column 'text' \(columns: \['body', 'n'\]"):
    _make(files_cfg(dict(paths=path, format="parquet")))


@pytest.mark.parametrize("change, match", [
    (dict(source="files", sources=()), r"config.data.sources: source='files' needs"),
    (dict(sources=[dict(paths="x", format="text")]), r"config.data.source is 'default'"),
    (dict(source="files", sources=[dict(paths="x", format="csv")]),
     r"config.data.sources\[0\].format must be one of"),
    (dict(source="files", sources=[dict(paths="x", format="text", colum="y")]),
     r"config.data.sources\[0\]: unknown field\(s\) \['colum'\]"),
    (dict(source="files", sources=[dict(paths="x", format="text", weight=0)]),
     r"config.data.sources\[0\].weight must be a positive number"),
    (dict(source="files", sources=[dict(format="text")]), r"config.data.sources\[0\].paths"),
    (dict(heldout_every=-1), r"config.data.heldout_every"),
    (dict(tokenizer=dict(kind="bpe", path="", bos_token="", eos_token="")),
     r"config.data.tokenizer.kind must be one of"),
])
def test_bad_config_names_the_field(change, match):
  cfg = data.data_config()
  for k, v in change.items():
    cfg[k] = v
  with pytest.raises(ValueError, match=match):
    data.check_config(cfg)


def test_validation_without_heldout_documents(tmp_path):
  cfg = files_cfg(dict(paths=write_jsonl(tmp_path / "a.jsonl", _docs("a", 3)), format="jsonl"),
                  heldout_every=0)
  with pytest.raises(ValueError, match=r"config.data.sources\[0\]: no validation documents"):
    _make(cfg, split="validation")
  cfg.heldout_every = 5
  with pytest.raises(ValueError, match=r"no train documents among its 1"):
    _make(files_cfg(dict(paths=write_jsonl(tmp_path / "b.jsonl", ["x"]), format="jsonl"),
                    heldout_every=5))

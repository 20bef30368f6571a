"""python -m k3jax.data.prepare: text -> tokenized ArrayRecord shards the pipeline reads back."""

import base64
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from k3jax import data
from k3jax.data import prepare as prep
from k3jax.data import shards

SEQ = 32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tiktoken(path):
  merges = [b"th", b"he", b"the", b" the", b"at", b" c", b" cat", b"in", b"ing"]
  tokens = [bytes([b]) for b in range(256)] + merges
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
  return str(path)


def _docs(prefix, n, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "mat", "thing", "中文", "ünïcode", "\n"]
  return [f"{prefix}{i} " + " ".join(rng.choice(words, int(rng.integers(1, 30))))
          for i in range(n)]


def _write_jsonl(path, docs):
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  return str(path)


def _tok_cfg(path):
  c = data.data_config().tokenizer
  c.kind, c.path = "tiktoken", path
  return c


def _cfg(source, tokenizer, packing="first_fit"):
  cfg = data.data_config()
  cfg.source, cfg.sources, cfg.heldout_every, cfg.packing = "files", [source], 5, packing
  cfg.tokenizer = tokenizer
  return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """Two JSONL files (61 documents) prepared into shards of 7 documents with a tiktoken file."""
  d = tmp_path_factory.mktemp("prep")
  tok_cfg = _tok_cfg(write_tiktoken(d / "kimi.tiktoken"))
  tokenizer = data.make_tokenizer(tok_cfg)
  docs = _docs("a", 40) + _docs("b", 21, seed=1)
  _write_jsonl(d / "in-1.jsonl", docs[:40])
  _write_jsonl(d / "in-2.jsonl", docs[40:])
  manifest = prep.prepare([str(d / "in-*.jsonl")], {"format": "jsonl"}, tokenizer,
                          str(d / "out"), shard_size=7, progress=False)
  return d, tok_cfg, tokenizer, docs, manifest


def test_manifest_counts_and_tokenizer(prepared):
  d, _, tokenizer, docs, manifest = prepared
  lengths = [len(tokenizer.encode(t)) for t in docs]
  assert manifest["documents"] == 61 and manifest["tokens"] == sum(lengths)
  assert [s["documents"] for s in manifest["shards"]] == [7] * 8 + [5]
  assert manifest["tokenizer"] == tokenizer.fingerprint()
  assert manifest["inputs"] == [str(d / "in-1.jsonl"), str(d / "in-2.jsonl")]
  assert json.loads((d / "out" / "manifest.json").read_text()) == manifest
  paths = sorted(str(p) for p in (d / "out").glob("*.array_record"))
  assert len(paths) == 9
  token_shards = shards.TokenShards(paths, tokenizer)
  np.testing.assert_array_equal(token_shards.lengths, lengths)
  for i in (0, 6, 7, 60):
    np.testing.assert_array_equal(token_shards[i], tokenizer.encode(docs[i]))


@pytest.mark.parametrize("packing", data.PACKINGS)
def test_shards_give_the_tokens_of_on_the_fly_tokenization(prepared, packing):
  d, tok_cfg, _, _, _ = prepared
  text = _cfg(dict(paths=str(d / "in-*.jsonl"), format="jsonl"), tok_cfg, packing)
  arrayrecord = _cfg(dict(paths=str(d / "out" / "*.array_record"), format="arrayrecord"),
                     tok_cfg, packing)
  for split, num_epochs in (("train", None), ("validation", 1)):
    make = lambda cfg: list(itertools.islice(data.make_dataset(
        cfg, seq_len=SEQ, global_batch=4, seed=9, split=split, num_epochs=num_epochs), 6))
    for x, y in zip(make(text), make(arrayrecord), strict=True):
      for k in data.FEATURES:
        np.testing.assert_array_equal(x[k], y[k], err_msg=f"{split} {k}")


def test_parquet_and_text_inputs(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  docs = [d.replace("\n", "") for d in _docs("p", 9)]  # "\n\n" separates them below
  pq.write_table(pa.table({"body": docs}), str(tmp_path / "a.parquet"))
  (tmp_path / "a.txt").write_text("\n\n".join(docs))
  tokenizer = data.ByteTokenizer()
  for name, spec, pattern in (("pq", {"format": "parquet", "column": "body"}, "a.parquet"),
                              ("txt", {"format": "text", "separator": "\n\n"}, "a.txt")):
    manifest = prep.prepare([str(tmp_path / pattern)], spec, tokenizer, str(tmp_path / name),
                            shard_size=4, progress=False)
    assert manifest["documents"] == 9, name
    got = shards.TokenShards(sorted(str(p) for p in (tmp_path / name).glob("*.array_record")),
                             tokenizer)
    assert [tokenizer.decode(got[i]) for i in range(9)] == docs, name


def test_command_line(tmp_path):
  docs = _docs("c", 5)
  (tmp_path / "in.txt").write_text("\n\n".join(docs))
  out = tmp_path / "out"
  r = subprocess.run(
      [sys.executable, "-m", "k3jax.data.prepare", f"--input={tmp_path / 'in.txt'}",
       "--format=text", "--separator=\\n\\n", "--tokenizer=byte", f"--output_dir={out}",
       "--shard_size=2"],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr
  assert "5 documents" in r.stdout and "3 shard(s)" in r.stdout
  assert "prepare" in r.stderr  # the progress bar (or line)
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["documents"] == 5 and manifest["tokenizer"]["kind"] == "byte"


def test_tokenizer_flag():
  assert prep.tokenizer_from_flag("byte").kind == "byte"
  assert (prep.tokenizer_from_flag("/m/tiktoken.model").kind,
          prep.tokenizer_from_flag("/m/x.tiktoken").kind,
          prep.tokenizer_from_flag("/m/sp.model").kind,
          prep.tokenizer_from_flag("/m/tokenizer.json").kind) == (
              "tiktoken", "tiktoken", "sentencepiece", "huggingface")
  c = prep.tokenizer_from_flag("huggingface:/m/t.bin", "<s>", "</s>")
  assert (c.kind, c.path, c.bos_token, c.eos_token) == ("huggingface", "/m/t.bin", "<s>", "</s>")
  with pytest.raises(ValueError, match="KIND:PATH"):
    prep.tokenizer_from_flag("/m/vocab.bin")


# --- errors ----------------------------------------------------------------------------------


def test_shards_refuse_another_tokenizer(prepared):
  d = prepared[0]
  cfg = _cfg(dict(paths=str(d / "out" / "*.array_record"), format="arrayrecord"),
             data.data_config().tokenizer)  # byte
  with pytest.raises(ValueError, match=r"out: tokenized with a tiktoken tokenizer kimi.tiktoken "
                                       r"\(521 ids\), but config.data.tokenizer is the byte"):
    data.make_dataset(cfg, seq_len=SEQ, global_batch=4, seed=0)


def test_output_dir_must_be_new(prepared):
  d, _, tokenizer, _, _ = prepared
  with pytest.raises(FileExistsError, match="already holds prepared shards"):
    prep.prepare([str(d / "in-1.jsonl")], {"format": "jsonl"}, tokenizer, str(d / "out"),
                 shard_size=7, progress=False)


def test_not_shards(tmp_path, prepared):
  tokenizer = prepared[2]
  (tmp_path / "x.array_record").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="no manifest.json"):
    shards.TokenShards([str(tmp_path / "x.array_record")], tokenizer)
  with pytest.raises(ValueError, match=r"manifest.json: not an ArrayRecord shard"):
    shards.TokenShards([str(prepared[0] / "out" / "manifest.json")], tokenizer)
  with pytest.raises(ValueError, match="--format must be one of"):
    prep.prepare([str(tmp_path / "x.array_record")], {"format": "arrayrecord"}, tokenizer,
                 str(tmp_path / "o"), shard_size=1, progress=False)

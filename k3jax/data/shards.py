"""Tokenized documents in ArrayRecord shards: written by `k3jax.data.prepare`, read lazily.

A directory holds shard-NNNNNN.array_record (one record per document: int32 LE ids, no
specials), its .lengths.npy (int64 [docs]) and manifest.json (tokenizer fingerprint).
Documents keep read order, so held-out picks match reading the text directly."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence

import numpy as np

MANIFEST = "manifest.json"
SHARD_SUFFIX = ".array_record"
LENGTHS_SUFFIX = ".lengths.npy"
FORMAT_VERSION = "k3jax.tokens/1"
TOKEN_DTYPE = "<i4"


def shard_name(index: int) -> str:
  return f"shard-{index:06d}{SHARD_SUFFIX}"


class ShardWriter:
  """Writes documents' token ids into shards of `shard_size` documents, then the manifest.
    with ShardWriter(out_dir, tokenizer, shard_size=100_000, inputs=[...]) as w:
      for doc in documents:
        w.add(tokenizer.encode(doc))"""

  def __init__(self, output_dir: str, tokenizer, *, shard_size: int, inputs: Sequence[str] = (),
               source: dict | None = None):
    if shard_size < 1:
      raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    os.makedirs(output_dir, exist_ok=True)
    if os.path.exists(os.path.join(output_dir, MANIFEST)):
      raise FileExistsError(f"{output_dir} already holds prepared shards ({MANIFEST}); "
                            f"choose an empty output directory")
    self.output_dir = output_dir
    self.tokenizer = tokenizer
    self.shard_size = shard_size
    self.inputs = list(inputs)
    self.source = source or {}
    self.shards: list[dict] = []
    self._writer = None
    self._lengths: list[int] = []
    self._written: list[str] = []
    self.manifest: dict | None = None

  def add(self, tokens: np.ndarray) -> None:
    """Append one document: int32 [n] token ids without bos / eos."""
    if self._writer is None:
      from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415
      path = os.path.join(self.output_dir, shard_name(len(self.shards)))
      # group_size:1: every record is its own chunk, so random access reads one document.
      self._writer = ArrayRecordWriter(path, "group_size:1")
      self._written += [path, path + LENGTHS_SUFFIX]
    self._writer.write(np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes())
    self._lengths.append(len(tokens))
    if len(self._lengths) == self.shard_size:
      self._finish_shard()

  def _finish_shard(self) -> None:
    self._writer.close()
    self._writer = None
    name = shard_name(len(self.shards))
    lengths = np.asarray(self._lengths, dtype=np.int64)
    np.save(os.path.join(self.output_dir, name + LENGTHS_SUFFIX), lengths)
    self.shards.append({"file": name, "documents": len(lengths), "tokens": int(lengths.sum())})
    self._lengths = []

  def close(self) -> dict:
    """Finish the last shard and write the manifest; returns it."""
    if self._writer is not None:
      self._finish_shard()
    manifest = {
        "format": FORMAT_VERSION,
        "dtype": TOKEN_DTYPE,
        "tokenizer": self.tokenizer.fingerprint(),
        "source": self.source,
        "inputs": self.inputs,
        "documents": sum(s["documents"] for s in self.shards),
        "tokens": sum(s["tokens"] for s in self.shards),
        "shards": self.shards,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(os.path.join(self.output_dir, MANIFEST), "w", encoding="utf-8") as f:
      json.dump(manifest, f, indent=1)
    self.manifest = manifest
    return manifest

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    if exc_type is None:
      self.close()
      return
    # A failed run leaves nothing behind: no manifest, no partial shards.
    if self._writer is not None:
      self._writer.close()
    for path in self._written:
      if os.path.exists(path):
        os.remove(path)


def read_manifest(directory: str) -> dict:
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory}: no {MANIFEST}: not a directory written by "
                            f"python -m k3jax.data.prepare")
  with open(path, encoding="utf-8") as f:
    manifest = json.load(f)
  if manifest.get("format") != FORMAT_VERSION:
    raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION!r}")
  return manifest


def check_tokenizer(manifest: dict, tokenizer, where: str) -> None:
  """ValueError unless the shards were written with the same vocabulary as `tokenizer`."""
  want, have = manifest["tokenizer"], tokenizer.fingerprint()
  keys = ("kind", "sha256", "vocab_size", "bos_id", "eos_id")
  diff = [k for k in keys if want.get(k) != have.get(k)]
  if diff:
    raise ValueError(
        f"{where}: tokenized with a {want['kind']} tokenizer {want.get('file') or ''} "
        f"({want['vocab_size']} ids), but config.data.tokenizer is the "
        f"{tokenizer.describe()}; they differ in {diff}")


class TokenShards:
  """Random access to prepared shards `paths`: `shards[i]` -> int32 [lengths[i]]."""

  def __init__(self, paths: Sequence[str], tokenizer):
    from grain.sources import ArrayRecordDataSource  # noqa: PLC0415
    lengths, manifests = [], {}
    for path in paths:
      if not path.endswith(SHARD_SUFFIX):
        raise ValueError(f"{path}: not an ArrayRecord shard (*{SHARD_SUFFIX})")
      directory = os.path.dirname(os.path.abspath(path))
      if directory not in manifests:
        manifests[directory] = read_manifest(directory)
        check_tokenizer(manifests[directory], tokenizer, directory)
      entry = {s["file"]: s for s in manifests[directory]["shards"]}.get(os.path.basename(path))
      if entry is None:
        raise ValueError(f"{path}: not listed in {os.path.join(directory, MANIFEST)}")
      n = np.load(path + LENGTHS_SUFFIX)
      if not len(n):
        raise ValueError(f"{path}: empty shard (no documents)")
      if len(n) != entry["documents"]:
        raise ValueError(f"{path}{LENGTHS_SUFFIX}: {len(n)} lengths, the manifest says "
                         f"{entry['documents']} documents")
      lengths.append(n)
    self.paths = list(paths)
    self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    self._source = ArrayRecordDataSource(self.paths)
    if len(self._source) != len(self.lengths):
      raise ValueError(f"{self.paths}: {len(self._source)} records, lengths files say "
                       f"{len(self.lengths)}")

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i: int) -> np.ndarray:
    return np.frombuffer(self._source[int(i)], dtype=TOKEN_DTYPE).astype(np.int32)

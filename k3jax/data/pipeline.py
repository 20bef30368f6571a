"""The training input pipeline, built from grain datasets.

  documents -> tokens [bos] + bytes + [eos]
    -> per document: inputs = tok[:-1], targets = tok[1:]
    -> pieces of at most seq_len (each piece is its own segment)
    -> global shuffle with `seed`, reshuffled every epoch -> repeat
    -> packing into rows of seq_len -> global batches of global_batch rows
    -> process shard: process p of n keeps rows [p * local_batch, (p + 1) * local_batch)

The global batches do not depend on the number of processes: 2 processes x 4 devices train
on the very batches of 1 process x 8, and since every process is at the same position,
any one's iterator state (the checkpoint stores process 0's) resumes a run under any
process count. The price: every process packs the whole global batch (numpy work, small
next to a step).

Every element is a dict of numpy arrays, each [local_batch, seq_len]:
  inputs       int32   token ids fed to the model
  targets      int32   the next token of the same document
  segment_ids  int32   1, 2, ... per document piece in the row; 0 = padding
  positions    int32   0, 1, ... within each piece; 0 on padding
  weights      float32 1.0 where the target is a real token, 0.0 on padding

The returned `grain.IterDataset` is checkpointable: `it.get_state()` is a small
JSON-serialisable dict and `it.set_state(state)` on a fresh iterator resumes
with exactly the same batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grain
import ml_collections
import numpy as np

from k3jax.data.corpus import default_documents
from k3jax.data.tokenizer import ByteTokenizer

SOURCES = ("default",)
# "first_fit": whole pieces, first-fit into local_batch rows, the rest padded.
# "concat_then_split": pieces laid end to end, cut every seq_len; no padding, but a
#   piece cut at a row end continues in the next row as a new segment (positions from 0).
PACKINGS = ("first_fit", "concat_then_split")
FEATURES = ("inputs", "targets", "segment_ids", "positions", "weights")


def data_config() -> ml_collections.ConfigDict:
  """Defaults of the `data` section of an experiment config."""
  c = ml_collections.ConfigDict()
  c.source = "default"      # one of SOURCES
  c.packing = "first_fit"   # one of PACKINGS
  return c


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field of the `data` section."""
  if cfg.source not in SOURCES:
    raise ValueError(f"config.data.source must be one of {SOURCES}, got {cfg.source!r}")
  if cfg.packing not in PACKINGS:
    raise ValueError(f"config.data.packing must be one of {PACKINGS}, got {cfg.packing!r}")


def _documents(cfg: ml_collections.ConfigDict, split: str) -> list[str]:
  """The documents of `split` from the source that `cfg.source` names."""
  check_config(cfg)
  return default_documents(split)


def document_pieces(
    docs: Sequence[str], tokenizer: ByteTokenizer, seq_len: int
) -> list[dict[str, np.ndarray]]:
  """Every document as next-token pairs, cut into pieces of at most `seq_len`.

  Returns, in document order, dicts {"inputs": int32 [n], "targets": int32 [n]}
  with 1 <= n <= seq_len; a document of b bytes gives b + 1 pairs in all.
  """
  pieces = []
  for doc in docs:
    tok = np.concatenate([[tokenizer.bos], tokenizer.encode(doc), [tokenizer.eos]]).astype(np.int32)
    inputs, targets = tok[:-1], tok[1:]
    for start in range(0, len(inputs), seq_len):
      pieces.append({
          "inputs": inputs[start:start + seq_len],
          "targets": targets[start:start + seq_len],
      })
  return pieces


def _check_process(process_index: int, process_count: int):
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
        f"need 0 <= process_index < process_count, got {process_index} of {process_count}")


def piece_dataset(
    cfg: ml_collections.ConfigDict,
    *,
    seq_len: int,
    seed: int,
    split: str = "train",
    num_epochs: int | None = None,
) -> grain.MapDataset:
  """The shuffled, repeated stream of pieces, before packing (the same on every process).

  Piece i of epoch e sits at index e * num_pieces + i.
  """
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}")
  pieces = document_pieces(_documents(cfg, split), ByteTokenizer(), seq_len)
  return grain.MapDataset.source(pieces).shuffle(seed=seed).repeat(num_epochs)


class _RestoreSliceTuples(grain.IterDataset):
  """Passes elements through; makes a JSON round trip of ConcatThenSplit's state harmless.

  grain 0.2.18's ConcatThenSplit compares each `remainder_slices` entry with the
  tuple (-1, -1). JSON (what grain's own CheckpointHandler writes) turns those
  tuples into lists, and the restored iterator would then replay a phantom
  remainder. This turns them back into tuples before restoring.
  """

  def __iter__(self) -> grain.DatasetIterator:
    return _RestoreSliceTuplesIterator(self._parent.__iter__())


class _RestoreSliceTuplesIterator(grain.DatasetIterator):

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    slices = {k: tuple(v) for k, v in state["remainder_slices"].items()}
    self._parent.set_state({**state, "remainder_slices": slices})


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  segment_ids = packed["inputs_segment_ids"]
  return {
      "inputs": packed["inputs"],
      "targets": packed["targets"],
      "segment_ids": segment_ids,
      "positions": packed["inputs_positions"],
      "weights": (segment_ids > 0).astype(np.float32),
  }


def _stack_rows(rows: Sequence[dict[str, np.ndarray]], batch: int) -> dict[str, np.ndarray]:
  """Stack rows into [batch, seq_len]; a short last batch gets all-padding rows."""
  pad = batch - len(rows)
  return {k: np.pad(np.stack([r[k] for r in rows]), ((0, pad), (0, 0))) for k in FEATURES}


def make_dataset(
    cfg: ml_collections.ConfigDict,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
    num_epochs: int | None = None,
) -> grain.IterDataset:
  """This process' `global_batch // process_count` rows of each global batch.

  `num_epochs=None` repeats forever (training); an integer gives a finite
  stream (e.g. 1 for one pass over the validation split) whose last batch is
  filled up with all-padding rows.
  """
  _check_process(process_index, process_count)
  if global_batch < 1 or global_batch % process_count:
    raise ValueError(
        f"global_batch={global_batch} must be a positive multiple of "
        f"process_count={process_count}")
  local_batch = global_batch // process_count
  ds = piece_dataset(cfg, seq_len=seq_len, seed=seed, split=split, num_epochs=num_epochs)
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  lengths = {"inputs": seq_len, "targets": seq_len}
  if cfg.packing == "first_fit":
    # global_batch bins: every piece fits an empty bin, so each flush is one full batch.
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=global_batch, shuffle_bins=False)
  else:
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)
    ds = _RestoreSliceTuples(ds)
  ds = ds.map(_row)
  ds = ds.batch(global_batch, batch_fn=functools.partial(_stack_rows, batch=global_batch))
  rows = slice(process_index * local_batch, (process_index + 1) * local_batch)
  return ds.map(lambda batch: {k: v[rows] for k, v in batch.items()})

"""Random-token batches with every feature of the pipeline's: steps timed or compiled
without reading data."""

from __future__ import annotations

import numpy as np

from k3jax.data.pipeline import FEATURES


def synthetic_batch(rows: int, seq_len: int, vocab_size: int, *, documents: int = 1,
                    seed: int = 0) -> dict[str, np.ndarray]:
  """A batch of uniform random tokens, `documents` documents a row laid end to end (equal
  lengths, the last takes the remainder), every token weighted. -> {FEATURES: [rows,
  seq_len]}: targets are the next token of the same document stream, segment_ids 1, 2, ...
  per document, positions from 0 in each."""
  if not 1 <= documents <= seq_len:
    raise ValueError(f"documents: {documents} a row must be in [1, seq_len = {seq_len}]")
  tokens = np.random.default_rng(seed).integers(0, vocab_size, (rows, seq_len + 1))
  doc = np.minimum(np.arange(seq_len) // (seq_len // documents), documents - 1)
  starts = np.searchsorted(doc, doc)            # each position's document start
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.broadcast_to(doc + 1, (rows, seq_len)),
           "positions": np.broadcast_to(np.arange(seq_len) - starts, (rows, seq_len)),
           "weights": np.ones((rows, seq_len), np.float32)}
  return {k: np.ascontiguousarray(batch[k], np.float32 if k == "weights" else np.int32)
          for k in FEATURES}

"""The embedded default corpus: the English topic texts of Python's `pydoc_data`.

Ships with every CPython, so it needs no download. It is ~466 KB of UTF-8 on
Python 3.11 (79 documents); the exact text changes with the Python version."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydoc_data import topics

SPLITS = ("train", "validation")
HELDOUT_EVERY = 20  # document i (in sorted topic order) is held out when i % 20 == 0


def default_documents(split: str) -> list[str]:
  """The documents of `split` ("train" or "validation"), topics in sorted key order."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  texts = [topics.topics[k] for k in sorted(topics.topics)]
  want_heldout = split == "validation"
  return [t for i, t in enumerate(texts) if (i % HELDOUT_EVERY == 0) == want_heldout]


def unigram_entropy(documents: Sequence[str], tokenizer) -> float:
  """Unigram entropy of the targets in nats per token: the loss to beat."""
  counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
  for doc in documents:
    counts += np.bincount(tokenizer.encode(doc), minlength=tokenizer.vocab_size)
    counts[tokenizer.eos] += 1
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())

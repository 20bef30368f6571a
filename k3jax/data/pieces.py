"""Documents of token ids -> random-access next-token pieces of at most seq_len.

A document of n ids gives n + 1 (input, target) pairs; only (document, start) per piece
is kept, so documents may live on disk."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenDocuments:
  """Documents held in memory: `docs[i]` -> int32 [lengths[i]] (one flat array underneath)."""

  def __init__(self, documents: Sequence[np.ndarray]):
    self.lengths = np.asarray([len(d) for d in documents], dtype=np.int64)
    self._offsets = np.concatenate([[0], np.cumsum(self.lengths)])
    self._tokens = (np.concatenate(documents).astype(np.int32) if len(documents)
                    else np.zeros(0, np.int32))

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i: int) -> np.ndarray:
    return self._tokens[self._offsets[i]:self._offsets[i + 1]]


class Subset:
  """Documents `ids` of `documents`, renumbered 0, 1, ... (e.g. a held-out split)."""

  def __init__(self, documents, ids: np.ndarray):
    self._documents = documents
    self._ids = np.asarray(ids, dtype=np.int64)
    self.lengths = np.asarray(documents.lengths)[self._ids]

  def __len__(self) -> int:
    return len(self._ids)

  def __getitem__(self, i: int) -> np.ndarray:
    return self._documents[int(self._ids[i])]


class DocumentPieces:
  """`pieces[i]` -> {"inputs": int32 [n], "targets": int32 [n]}, 1 <= n <= seq_len.
  Pieces are in document order, and in order within a document. `documents` needs
  `__getitem__` (-> int32 token ids, no bos / eos) and `lengths` (int [num_documents])."""

  def __init__(self, documents, *, bos: int, eos: int, seq_len: int):
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    self._documents = documents
    self._bos, self._eos, self._seq_len = bos, eos, seq_len
    pairs = np.asarray(documents.lengths, dtype=np.int64) + 1
    counts = -(-pairs // seq_len)
    self._doc = np.repeat(np.arange(len(pairs)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    self._start = (np.arange(len(self._doc)) - first) * seq_len

  def __len__(self) -> int:
    return len(self._doc)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    ids = self._documents[int(self._doc[i])]
    s, n = int(self._start[i]), len(ids)
    # The window full[s : s + seq_len + 1] of full = [bos] + ids + [eos].
    parts = [ids[max(s - 1, 0):s + self._seq_len]]
    if s == 0:
      parts.insert(0, [self._bos])
    if s + self._seq_len >= n + 1:
      parts.append([self._eos])
    window = np.concatenate(parts).astype(np.int32)
    return {"inputs": window[:-1], "targets": window[1:]}

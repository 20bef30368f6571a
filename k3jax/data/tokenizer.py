"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then the specials."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
  """UTF-8 bytes as token ids, plus `bos` (256) and `eos` (257).

  `encode` returns the bytes only; the pipeline adds `bos` / `eos` around each
  document. `decode` drops every id that is not a byte.
  """

  bos = 256
  eos = 257
  vocab_size = 258

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 [len(text.encode('utf-8'))]."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Ids (any int sequence or array) -> text; specials are skipped, bad UTF-8 replaced."""
    ids = np.asarray(ids).reshape(-1)
    data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")

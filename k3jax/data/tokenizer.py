"""Tokenizers: text -> int32 token ids, one interface for every kind of vocabulary file.

  byte            no file; bos 256, eos 257, ids 0..255 are UTF-8 bytes
  tiktoken        a BPE rank file in Kimi's format; 256 reserved specials after the ranks
  sentencepiece   a `.model`; its bos / eos pieces unless named
  huggingface     a tokenizer.json; bos / eos named in the config

Each has `encode` (no specials), `decode`, `vocab_size`, `bos_id`, `eos_id`, `fingerprint()`."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re

import ml_collections
import numpy as np

TOKENIZERS = ("byte", "tiktoken", "sentencepiece", "huggingface")

# Kimi's tokenizer (tokenization_kimi.py): its pre-tokenization pattern and the 256
# special ids after the BPE ranks, [BOS] and [EOS] first.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_NUM_SPECIAL = 256
KIMI_BOS, KIMI_EOS = "[BOS]", "[EOS]"
# tiktoken's regex fails on very long texts; Kimi's cuts change the ids, so we cut alike.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000


def tokenizer_config() -> ml_collections.ConfigDict:
  """Defaults of `data.tokenizer`."""
  c = ml_collections.ConfigDict()
  c.kind = "byte"      # one of TOKENIZERS
  c.path = ""          # the vocabulary file (all kinds but "byte")
  # Document delimiter names; "": the kind's own (huggingface needs both named)
  c.bos_token = ""
  c.eos_token = ""
  return c


class Tokenizer:
  """The common interface. Subclasses set `kind`, `path`, `vocab_size`, `bos_id`, `eos_id`."""

  kind: str = ""
  path: str = ""
  vocab_size: int
  bos_id: int
  eos_id: int

  @property
  def bos(self) -> int:
    return self.bos_id

  @property
  def eos(self) -> int:
    return self.eos_id

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 [n], no specials added."""
    raise NotImplementedError

  def decode(self, ids) -> str:
    """Ids (any int sequence or array) -> text; special ids are dropped."""
    raise NotImplementedError

  def fingerprint(self) -> dict:
    """What identifies the vocabulary: kind, file name and SHA-256, size, bos / eos ids."""
    return {
        "kind": self.kind,
        "file": os.path.basename(self.path),
        "sha256": _sha256(self.path) if self.path else "",
        "vocab_size": int(self.vocab_size),
        "bos_id": int(self.bos_id),
        "eos_id": int(self.eos_id),
    }

  def describe(self) -> str:
    where = f" {self.path}" if self.path else ""
    return (f"{self.kind} tokenizer{where} ({self.vocab_size:,} ids, bos {self.bos_id}, "
            f"eos {self.eos_id})")


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as token ids, plus `bos` (256) and `eos` (257)."""

  kind = "byte"
  bos = bos_id = 256
  eos = eos_id = 257
  vocab_size = 258

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 [len(text.encode('utf-8'))]."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Ids (any int sequence or array) -> text; specials are skipped, bad UTF-8 replaced."""
    ids = np.asarray(ids).reshape(-1)
    data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """{token bytes: rank} of a `base64(token) rank` file; ValueError naming path:line."""
  ranks: dict[bytes, int] = {}
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      fields = line.split()
      try:
        if len(fields) != 2:
          raise ValueError(f"{len(fields)} fields")
        ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
      except ValueError as e:
        raise ValueError(f"{path}:{lineno}: not a tiktoken rank line 'base64 rank' ({e})") from e
  if not ranks:
    raise ValueError(f"{path}: empty tiktoken rank file")
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise ValueError(f"{path}: {len(missing)} single bytes have no rank (first: {missing[0]}); "
                     f"a byte-level BPE file ranks all 256")
  return ranks


def _tiktoken_slices(text: str):
  """Kimi's cuts: slices of <= 400,000 chars, runs of (non-)whitespace of <= 25,000."""
  for i in range(0, max(len(text), 1), _TIKTOKEN_MAX_CHARS):
    s = text[i:i + _TIKTOKEN_MAX_CHARS]
    if len(s) <= _TIKTOKEN_MAX_RUN:
      yield s
      continue
    start = 0
    for run in re.finditer(r"\s+|\S+", s):  # \s is str.isspace() in Unicode patterns
      for cut in range(run.start() + _TIKTOKEN_MAX_RUN, run.end(), _TIKTOKEN_MAX_RUN):
        yield s[start:cut]
        start = cut
    yield s[start:]


class TiktokenTokenizer(Tokenizer):
  """A tiktoken BPE rank file read the way Kimi reads its `tiktoken.model`.
  vocab_size = n + 256 specials ([BOS] = n, [EOS] = n + 1 unless a tokenizer_config.json
  beside it says otherwise). Special names in text encode as plain text, so training text
  cannot fake a document boundary."""

  kind = "tiktoken"

  def __init__(self, path: str, bos_token: str = "", eos_token: str = ""):
    import tiktoken  # noqa: PLC0415  (only needed for this kind)
    _check_file(path, "config.data.tokenizer.path")
    ranks = load_tiktoken_ranks(path)
    n = len(ranks)
    names = {n + i: f"<|reserved_token_{n + i}|>" for i in range(KIMI_NUM_SPECIAL)}
    names[n], names[n + 1] = KIMI_BOS, KIMI_EOS
    names.update(_added_tokens(os.path.join(os.path.dirname(path), "tokenizer_config.json"),
                               range(n, n + KIMI_NUM_SPECIAL)))
    self.specials = {name: i for i, name in names.items()}
    self.path = path
    self.num_ranks = n
    self.vocab_size = n + KIMI_NUM_SPECIAL
    self.bos_id = self._special(bos_token or KIMI_BOS, "bos_token")
    self.eos_id = self._special(eos_token or KIMI_EOS, "eos_token")
    self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=KIMI_PAT_STR,
                                  mergeable_ranks=ranks, special_tokens=self.specials)

  def _special(self, name: str, field: str) -> int:
    if name not in self.specials:
      raise ValueError(f"config.data.tokenizer.{field}: {name!r} is not a special token of "
                       f"{self.path} (ids {self.num_ranks}..{self.vocab_size - 1})")
    return self.specials[name]

  def encode(self, text: str) -> np.ndarray:
    ids = [i for s in _tiktoken_slices(text) for i in self._enc.encode_ordinary(s)]
    return np.asarray(ids, dtype=np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.num_ranks)]
    return self._enc.decode(ids.tolist(), errors="replace")


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece `.model`; bos / eos are its own bos / eos pieces unless named."""

  kind = "sentencepiece"

  def __init__(self, path: str, bos_token: str = "", eos_token: str = ""):
    import sentencepiece  # noqa: PLC0415
    _check_file(path, "config.data.tokenizer.path")
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
      raise ValueError(f"{path}: not a SentencePiece model ({e})") from e
    self.path = path
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id = self._piece(bos_token, self._sp.bos_id(), "bos_token")
    self.eos_id = self._piece(eos_token, self._sp.eos_id(), "eos_token")

  def _piece(self, name: str, default: int, field: str) -> int:
    if not name:
      if default < 0:
        raise ValueError(f"{self.path} defines no {field[:3]} piece: name one in "
                         f"config.data.tokenizer.{field}")
      return default
    i = self._sp.piece_to_id(name)
    if self._sp.id_to_piece(i) != name:  # unknown pieces map to unk
      raise ValueError(f"config.data.tokenizer.{field}: {name!r} is not a piece of {self.path}")
    return i

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size)]
    ids = [i for i in ids.tolist() if not self._sp.is_control(i)]
    return self._sp.decode(ids)


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face tokenizer.json; bos / eos must be named; no post-processor applied."""

  kind = "huggingface"

  def __init__(self, path: str, bos_token: str = "", eos_token: str = ""):
    import tokenizers  # noqa: PLC0415
    _check_file(path, "config.data.tokenizer.path")
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust loader raises a bare Exception
      raise ValueError(f"{path}: not a tokenizers tokenizer.json ({e})") from e
    self.path = path
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1 if vocab else 0
    self.bos_id = self._token(bos_token, "bos_token")
    self.eos_id = self._token(eos_token, "eos_token")

  def _token(self, name: str, field: str) -> int:
    if not name:
      raise ValueError(f"config.data.tokenizer.{field}: a huggingface tokenizer needs it named "
                       f"(a token of {self.path}, e.g. '<|endoftext|>' or '</s>')")
    i = self._tok.token_to_id(name)
    if i is None:
      raise ValueError(f"config.data.tokenizer.{field}: {name!r} is not a token of {self.path}")
    return i

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size)]
    return self._tok.decode(ids.tolist(), skip_special_tokens=True)


_KINDS = {
    "tiktoken": TiktokenTokenizer,
    "sentencepiece": SentencePieceTokenizer,
    "huggingface": HuggingFaceTokenizer,
}


def check_tokenizer_config(cfg: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field of `data.tokenizer` (files are not read)."""
  if cfg.kind not in TOKENIZERS:
    raise ValueError(f"config.data.tokenizer.kind must be one of {TOKENIZERS}, got {cfg.kind!r}")
  if cfg.kind != "byte" and not cfg.path:
    raise ValueError(f"config.data.tokenizer.path: the {cfg.kind} tokenizer needs its file")


def make_tokenizer(cfg: ml_collections.ConfigDict) -> Tokenizer:
  """The tokenizer `data.tokenizer` names (one instance per process and file)."""
  check_tokenizer_config(cfg)
  return _load(cfg.kind, os.path.abspath(cfg.path) if cfg.path else "", cfg.bos_token,
               cfg.eos_token)


@functools.lru_cache(maxsize=8)
def _load(kind: str, path: str, bos_token: str, eos_token: str) -> Tokenizer:
  if kind == "byte":
    return ByteTokenizer()
  return _KINDS[kind](path, bos_token, eos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raise ValueError when the model's embedding has fewer rows than the tokenizer has ids."""
  if tokenizer.vocab_size > model_vocab_size:
    need = -(-tokenizer.vocab_size // 128) * 128
    raise ValueError(
        f"config.model.vocab_size: {model_vocab_size} is smaller than the vocabulary of the "
        f"{tokenizer.describe()}: {tokenizer.vocab_size}; set it to at least "
        f"{tokenizer.vocab_size} (e.g. {need}, a multiple of 128)")


def _check_file(path: str, field: str) -> None:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{field}: no file {path}")


def _added_tokens(config_path: str, ids: range) -> dict[int, str]:
  if not os.path.isfile(config_path):
    return {}
  try:
    with open(config_path, encoding="utf-8") as f:
      added = json.load(f).get("added_tokens_decoder", {})
    return {int(i): t["content"] for i, t in added.items() if int(i) in ids}
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{config_path}: unreadable added_tokens_decoder ({e!r})") from e


@functools.lru_cache(maxsize=16)
def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()

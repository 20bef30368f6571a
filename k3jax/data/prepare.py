"""Entry point: tokenize text files once into ArrayRecord shards that the pipeline reads lazily.

  python -m k3jax.data.prepare --input='/data/web/*.jsonl.gz' --format=jsonl \\
      --tokenizer=tiktoken:/models/kimi/tiktoken.model --output_dir=/data/web_kimi
  # then: c.data.sources = [dict(paths=".../*.array_record", format="arrayrecord")]

--tokenizer: "byte", KIND:PATH, or a PATH naming the kind; other vocabularies are refused."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

import ml_collections
from absl import app, flags

from k3jax.data import sources as sources_lib
from k3jax.data.shards import MANIFEST, ShardWriter
from k3jax.data.tokenizer import TOKENIZERS, Tokenizer, make_tokenizer, tokenizer_config

_INPUT = flags.DEFINE_list("input", None, "glob pattern(s) of the text files, comma-separated")
_FORMAT = flags.DEFINE_enum("format", None, list(sources_lib.TEXT_FORMATS), "input format")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "byte | KIND:PATH | PATH")
_BOS = flags.DEFINE_string("bos_token", "", "bos token name (default: the tokenizer kind's)")
_EOS = flags.DEFINE_string("eos_token", "", "eos token name (default: the tokenizer kind's)")
_OUTPUT = flags.DEFINE_string("output_dir", None, "new directory for the shards and manifest")
_SHARD_SIZE = flags.DEFINE_integer("shard_size", 50_000, "documents per shard")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "jsonl: the key of the text")
_COLUMN = flags.DEFINE_string("column", "text", "parquet: the text column")
_SEPARATOR = flags.DEFINE_string("separator", "", "text: between documents; '' = one per file")


def tokenizer_from_flag(value: str, bos_token: str = "", eos_token: str = ""
                        ) -> ml_collections.ConfigDict:
  """'byte' | 'KIND:PATH' | 'PATH' -> a `data.tokenizer` config section."""
  c = tokenizer_config()
  c.bos_token, c.eos_token = bos_token, eos_token
  kind, sep, path = value.partition(":")
  if sep and kind in TOKENIZERS:
    c.kind, c.path = kind, path
  elif value == "byte":
    c.kind = "byte"
  else:
    name = os.path.basename(value)
    if name.endswith(".tiktoken") or name == "tiktoken.model":
      c.kind = "tiktoken"
    elif name.endswith(".model"):
      c.kind = "sentencepiece"
    elif name.endswith(".json"):
      c.kind = "huggingface"
    else:
      raise ValueError(f"--tokenizer={value!r}: say the kind, KIND:PATH with KIND one of "
                       f"{TOKENIZERS}")
    c.path = value
  return c


class _Progress:
  """tqdm over input bytes when it is installed, else a stderr line every 10 s."""

  def __init__(self, total_bytes: int):
    self.done, self.docs, self.tokens = 0, 0, 0
    self._t0 = self._last = time.time()
    self._total = total_bytes
    try:
      import tqdm  # noqa: PLC0415  (comes with tokenizers' huggingface_hub; optional)
      self._bar = tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare",
                            file=sys.stderr)
    except ImportError:
      self._bar = None

  def update(self, nbytes: int, docs: int, tokens: int, final: bool = False) -> None:
    self.docs += docs
    self.tokens += tokens
    if self._bar is not None:
      self._bar.update(nbytes)
      self._bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)
      return
    self.done += nbytes
    now = time.time()
    if final or now - self._last >= 10:
      self._last = now
      print(f"prepare: {self.done / max(self._total, 1):6.1%} of {self._total:,} bytes, "
            f"{self.docs:,} documents, {self.tokens:,} tokens, {now - self._t0:.0f} s",
            file=sys.stderr, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    else:
      self.update(0, 0, 0, final=True)


def prepare(patterns: Sequence[str], spec: dict, tokenizer: Tokenizer, output_dir: str, *,
            shard_size: int, progress: bool = True) -> dict:
  """Tokenize the files matching `patterns` (a source dict `spec`) into shards."""
  spec = sources_lib.source_spec({**spec, "paths": tuple(patterns)}, 0)
  if spec["format"] not in sources_lib.TEXT_FORMATS:
    raise ValueError(f"--format must be one of {sources_lib.TEXT_FORMATS}, "
                     f"got {spec['format']!r}")
  files = sources_lib.expand_paths(spec["paths"], "--input")
  sizes = [os.path.getsize(f) for f in files]
  source = {k: spec[k] for k in ("format", "text_field", "column", "separator")}
  writer = ShardWriter(output_dir, tokenizer, shard_size=shard_size,
                       inputs=[os.path.abspath(f) for f in files], source=source)
  bar = _Progress(sum(sizes)) if progress else None
  try:
    with writer:
      for path, size in zip(files, sizes):
        shown = docs = tokens = text_bytes = 0
        for doc in sources_lib.read_documents(path, spec):
          ids = tokenizer.encode(doc)
          writer.add(ids)
          docs, tokens, text_bytes = docs + 1, tokens + len(ids), text_bytes + len(doc)
          if bar is not None and docs % 256 == 0:
            step = min(text_bytes, size - shown)
            bar.update(step, docs, tokens)
            shown, docs, tokens, text_bytes = shown + step, 0, 0, 0
        if bar is not None:
          bar.update(size - shown, docs, tokens)
  finally:
    if bar is not None:
      bar.close()
  return writer.manifest


def _unescape(value: str) -> str:
  """'\\n\\n' as typed in a shell -> two newlines (non-ASCII characters kept)."""
  return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  for flag in (_INPUT, _FORMAT, _OUTPUT):
    if not flag.value:
      raise app.UsageError(f"--{flag.name} is required")
  try:
    tokenizer = make_tokenizer(tokenizer_from_flag(_TOKENIZER.value, _BOS.value, _EOS.value))
  except (OSError, ValueError) as e:
    raise SystemExit(f"prepare: error: {e}") from e
  spec = {"format": _FORMAT.value, "text_field": _TEXT_FIELD.value, "column": _COLUMN.value,
          "separator": _unescape(_SEPARATOR.value)}
  try:
    manifest = prepare(_INPUT.value, spec, tokenizer, _OUTPUT.value,
                       shard_size=_SHARD_SIZE.value)
  except (OSError, ValueError) as e:
    raise SystemExit(f"prepare: error: {e}") from e
  print(f"prepare: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens of the "
        f"{tokenizer.describe()} in {len(manifest['shards'])} shard(s); "
        f"{os.path.join(_OUTPUT.value, MANIFEST)}")


if __name__ == "__main__":
  app.run(main)

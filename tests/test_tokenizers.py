"""Tokenizers from local files (k3jax.data.tokenizer): one interface for every kind.

Every vocabulary file is built here, tiny, on the fly: a tiktoken rank file in Kimi's
format, a SentencePiece model trained in the test, a Hugging Face tokenizer.json.
"""

import base64
import io
import json

import numpy as np
import pytest

from k3jax import data
from k3jax.data import tokenizer as tok_lib

TEXT = "the cat sat on the mat. The other cat, the one at the door, sat there too.\n"
CORPUS = [TEXT, "a hat, a mat, a cat", "then there were three cats on the mat",
          "the theme of the thesis", "tea at the theatre"] * 20
MERGES = [b"th", b"he", b"the", b" the", b"at", b" c", b" cat", b"\xe4\xb8\xad\xe6\x96\x87"]


def write_tiktoken(path, merges=MERGES):
  """A rank file: the 256 bytes, then `merges`; returns the number of ranks."""
  tokens = [bytes([b]) for b in range(256)] + list(merges)
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
  return len(tokens)


def write_sentencepiece(path):
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=320, model_type="bpe",
      character_coverage=1.0, byte_fallback=True, hard_vocab_limit=False,
      bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2, num_threads=1,
      # keep the text as it is (the default NFKC rule drops newlines and extra spaces)
      normalization_rule_name="identity", remove_extra_whitespaces=False)
  path.write_bytes(model.getvalue())


def write_tokenizer_json(path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  t = Tokenizer(models.BPE())
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  t.train_from_iterator(CORPUS, trainer)
  t.save(str(path))


def tokenizer_cfg(kind, path="", **kw):
  c = data.data_config().tokenizer
  c.kind, c.path = kind, str(path)
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("tok")
  write_tiktoken(d / "kimi.tiktoken")
  write_sentencepiece(d / "sp.model")
  write_tokenizer_json(d / "tokenizer.json")
  return d


@pytest.fixture(scope="module")
def every_kind(files):
  return {
      "byte": data.make_tokenizer(tokenizer_cfg("byte")),
      "tiktoken": data.make_tokenizer(tokenizer_cfg("tiktoken", files / "kimi.tiktoken")),
      "sentencepiece": data.make_tokenizer(tokenizer_cfg("sentencepiece", files / "sp.model")),
      "huggingface": data.make_tokenizer(tokenizer_cfg(
          "huggingface", files / "tokenizer.json", bos_token="<s>", eos_token="</s>")),
  }


@pytest.mark.parametrize("kind", data.TOKENIZERS)
def test_common_interface_round_trips(every_kind, kind):
  tok = every_kind[kind]
  assert tok.kind == kind and isinstance(tok, data.Tokenizer)
  for text in (TEXT, "the hat", ""):
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert np.all((ids >= 0) & (ids < tok.vocab_size))
    assert tok.decode(ids) == text
  assert 0 <= tok.bos_id < tok.vocab_size and 0 <= tok.eos_id < tok.vocab_size
  assert tok.bos_id != tok.eos_id
  ids = tok.encode(TEXT)
  assert tok.bos_id not in ids and tok.eos_id not in ids          # text never makes a special
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == TEXT  # decode drops them
  fp = tok.fingerprint()
  assert fp["vocab_size"] == tok.vocab_size and (fp["sha256"] != "") == (kind != "byte")


def test_bpe_kinds_compress(every_kind):
  n_bytes = len(TEXT.encode())
  for kind in ("tiktoken", "sentencepiece", "huggingface"):
    assert len(every_kind[kind].encode(TEXT)) < n_bytes, kind


def test_tiktoken_kimi_layout(files):
  tok = data.make_tokenizer(tokenizer_cfg("tiktoken", files / "kimi.tiktoken"))
  n = 256 + len(MERGES)
  # Kimi: the ranks, then 256 reserved specials; [BOS] and [EOS] are the first two.
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1)
  rank = {t: 256 + i for i, t in enumerate(MERGES)}
  assert tok.encode(" the").tolist() == [rank[b" the"]]
  assert tok.encode(" cat").tolist() == [rank[b" cat"]]
  # The special names in a document are plain text, not specials.
  assert tok.decode(tok.encode("[EOS]")) == "[EOS]" and tok.eos_id not in tok.encode("[EOS]")


def test_tiktoken_kimi_pretokenization(files):
  tok = data.make_tokenizer(tokenizer_cfg("tiktoken", files / "kimi.tiktoken"))
  han = 256 + MERGES.index("中文".encode())
  # A run of Han characters is one pre-token, apart from the Latin letters around it.
  assert tok.encode("中文").tolist() == [han]
  assert tok.encode("中文the").tolist()[0] == han
  # Digits are grouped by at most three: "12345" never merges across "123|45".
  pieces = [tok.decode([i]) for i in tok.encode("12345")]
  assert "".join(pieces) == "12345"


def _kimi_cuts(s, max_run):
  """Kimi's _split_whitespaces_or_nonwhitespaces, literally (the reference)."""
  out, start, run, space = [], 0, 0, s[0].isspace() if s else False
  for i, ch in enumerate(s):
    if ch.isspace() != space:
      run, space = 1, ch.isspace()
    else:
      run += 1
      if run > max_run:
        out.append(s[start:i])
        start, run = i, 1
  out.append(s[start:])
  return out


def test_tiktoken_long_runs_cut_where_kimi_cuts(files):
  text = "ab " + "x" * 60_001 + " " * 25_000 + "\n" * 25_001 + "the end"
  assert list(tok_lib._tiktoken_slices(text)) == _kimi_cuts(text, tok_lib._TIKTOKEN_MAX_RUN)
  tok = data.make_tokenizer(tokenizer_cfg("tiktoken", files / "kimi.tiktoken"))
  assert tok.decode(tok.encode(text)) == text


def test_tiktoken_tokenizer_config_names_specials(tmp_path):
  n = write_tiktoken(tmp_path / "tiktoken.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
      str(n): {"content": "<|begin|>"}, str(n + 1): {"content": "<|stop|>"},
      str(n + 2): {"content": "<|end|>"}}}))
  tok = data.make_tokenizer(tokenizer_cfg("tiktoken", tmp_path / "tiktoken.model",
                                          bos_token="<|begin|>", eos_token="<|end|>"))
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 2, n + 256)
  with pytest.raises(ValueError, match=r"eos_token.*'\[EOS\]'.*not a special token"):
    data.make_tokenizer(tokenizer_cfg("tiktoken", tmp_path / "tiktoken.model",
                                      bos_token="<|begin|>"))


def test_sentencepiece_uses_the_models_bos_eos(every_kind, files):
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=str(files / "sp.model"))
  tok = every_kind["sentencepiece"]
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (sp.bos_id(), sp.eos_id(),
                                                      sp.get_piece_size())
  assert tok.encode(TEXT).tolist() == sp.encode(TEXT)


def test_huggingface_matches_the_library(every_kind, files):
  from tokenizers import Tokenizer
  ref = Tokenizer.from_file(str(files / "tokenizer.json"))
  tok = every_kind["huggingface"]
  assert tok.encode(TEXT).tolist() == ref.encode(TEXT, add_special_tokens=False).ids
  assert (tok.bos_id, tok.eos_id) == (ref.token_to_id("<s>"), ref.token_to_id("</s>"))


def test_check_vocab_names_both_sizes(every_kind):
  tok = every_kind["tiktoken"]
  data.check_vocab(tok, tok.vocab_size)
  with pytest.raises(ValueError, match=rf"config.model.vocab_size: 384 .*{tok.vocab_size}"):
    data.check_vocab(tok, 384)
  data.check_vocab(data.ByteTokenizer(), 384)


# --- errors ----------------------------------------------------------------------------------


def test_unknown_kind_and_missing_path(tmp_path):
  with pytest.raises(ValueError, match="config.data.tokenizer.kind"):
    data.make_tokenizer(tokenizer_cfg("wordpiece", tmp_path / "x"))
  with pytest.raises(ValueError, match="config.data.tokenizer.path"):
    data.make_tokenizer(tokenizer_cfg("tiktoken"))
  for kind in ("tiktoken", "sentencepiece", "huggingface"):
    with pytest.raises(FileNotFoundError, match="nothere"):
      data.make_tokenizer(tokenizer_cfg(kind, tmp_path / "nothere", bos_token="a", eos_token="b"))


def test_bad_tiktoken_files(tmp_path):
  bad = tmp_path / "bad.tiktoken"
  write_tiktoken(bad)
  bad.write_text(bad.read_text() + "not-base64!! 300\n")
  with pytest.raises(ValueError, match=r"bad.tiktoken:265: not a tiktoken rank line"):
    tok_lib.load_tiktoken_ranks(str(bad))
  gap = tmp_path / "gap.tiktoken"
  write_tiktoken(gap)
  gap.write_text(gap.read_text() + f"{base64.b64encode(b'zz').decode()} 999\n")
  with pytest.raises(ValueError, match=r"gap.tiktoken: ranks must be 0..264"):
    tok_lib.load_tiktoken_ranks(str(gap))
  short = tmp_path / "short.tiktoken"
  short.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)))
  with pytest.raises(ValueError, match=r"short.tiktoken: 56 single bytes have no rank"):
    tok_lib.load_tiktoken_ranks(str(short))
  (tmp_path / "empty.tiktoken").write_text("")
  with pytest.raises(ValueError, match="empty.tiktoken: empty"):
    tok_lib.load_tiktoken_ranks(str(tmp_path / "empty.tiktoken"))


def test_bad_special_names(files):
  with pytest.raises(ValueError, match="bos_token: a huggingface tokenizer needs it named"):
    data.make_tokenizer(tokenizer_cfg("huggingface", files / "tokenizer.json"))
  with pytest.raises(ValueError, match=r"eos_token: '<eos>' is not a token of .*tokenizer.json"):
    data.make_tokenizer(tokenizer_cfg("huggingface", files / "tokenizer.json", bos_token="<s>",
                                      eos_token="<eos>"))
  with pytest.raises(ValueError, match=r"bos_token: '<nope>' is not a piece of .*sp.model"):
    data.make_tokenizer(tokenizer_cfg("sentencepiece", files / "sp.model", bos_token="<nope>"))
  with pytest.raises(ValueError, match=r"not a SentencePiece model"):
    data.make_tokenizer(tokenizer_cfg("sentencepiece", files / "kimi.tiktoken"))

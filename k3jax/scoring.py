"""Log-likelihoods, text scores (loss, perplexity, bits per byte) and multiple-choice
accuracy, for `python -m k3jax.eval` and `k3jax.train`'s evals."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.data import sources


class Scorer:
  """Log-likelihoods of token sequences under a model, `batch` rows of `length` at once."""

  def __init__(self, model, length: int, batch: int):
    graphdef, state = nnx.split(model)
    self.length, self.batch, self.state = length, batch, state
    self.graphdef = graphdef

    @jax.jit
    def logprobs(state, tokens, segment_ids):     # [B, T] -> log p(token t + 1) [B, T - 1]
      logits, _ = nnx.merge(graphdef, state)(tokens, segment_ids)
      logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
      return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    self._logprobs = logprobs

  def load(self, model) -> None:
    """Score with `model`'s parameters from now on (the same structure: no recompile)."""
    graphdef, self.state = nnx.split(model)
    if graphdef != self.graphdef:
      raise ValueError("Scorer.load: a model of another structure than the scorer's")

  def __call__(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """log p of each token after the first, per sequence ([len - 1] float64 each)."""
    out = []
    for i in range(0, len(seqs), self.batch):
      part = seqs[i:i + self.batch]
      tokens = np.zeros((self.batch, self.length), np.int32)
      ids = np.zeros((self.batch, self.length), np.int32)
      for r, s in enumerate(part):
        if not 2 <= len(s) <= self.length:
          raise ValueError(f"a sequence of {len(s)} tokens: the scorer takes 2 to "
                           f"{self.length} (train.seq_len + 1)")
        tokens[r, :len(s)], ids[r, :len(s)] = s, 1
      lp = np.asarray(self._logprobs(self.state, jnp.asarray(tokens), jnp.asarray(ids)))
      out.extend(lp[r, :len(s) - 1].astype(np.float64) for r, s in enumerate(part))
    return out


def text_scores(scorer: Scorer, tok, documents: Sequence[str]) -> dict:
  """Mean loss per token, perplexity and bits per byte of the documents (module doc)."""
  if not documents:
    raise ValueError("no document to score")
  windows = []
  for doc in documents:
    ids = [tok.bos_id, *tok.encode(doc).tolist(), tok.eos_id]
    step = scorer.length - 1
    windows += [ids[i:i + scorer.length] for i in range(0, len(ids) - 1, step)]
  logps = scorer([w for w in windows if len(w) >= 2])
  nll, tokens = -sum(float(lp.sum()) for lp in logps), sum(len(lp) for lp in logps)
  nbytes = sum(len(d.encode("utf-8")) for d in documents)
  return {"documents": len(documents), "tokens": tokens, "loss": nll / tokens,
          "perplexity": math.exp(nll / tokens), "bits_per_byte": nll / math.log(2) / nbytes}


def read_choices(path: str) -> list[dict]:
  """The items of a multiple-choice JSONL file; ValueError naming file:line otherwise."""
  items = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        item = json.loads(line)
        ok = (isinstance(item.get("context"), str) and isinstance(item.get("choices"), list)
              and len(item["choices"]) >= 2 and all(isinstance(c, str) and c
                                                    for c in item["choices"])
              and isinstance(item.get("answer"), int)
              and 0 <= item["answer"] < len(item["choices"]))
      except (json.JSONDecodeError, AttributeError):
        ok = False
      if not ok:
        raise ValueError(f"{path}:{n}: need {{\"context\": str, \"choices\": [2 or more "
                         f"non-empty str], \"answer\": index of one}}")
      items.append(item)
  if not items:
    raise ValueError(f"{path}: no item")
  return items


def choice_scores(scorer: Scorer, tok, items: Sequence[dict]) -> dict:
  """Accuracy (raw and per byte of the choice) and its standard error (module doc)."""
  seqs, spans = [], []
  for item in items:
    ctx = [tok.bos_id, *tok.encode(item["context"]).tolist()]
    for c in item["choices"]:
      ids = tok.encode(c).tolist()
      seqs.append(ctx + ids)
      spans.append(len(ids))
  logps = scorer(seqs)
  k, right, right_norm = 0, 0, 0
  for item in items:
    n = len(item["choices"])
    ll = [float(lp[-m:].sum()) for lp, m in zip(logps[k:k + n], spans[k:k + n])]
    per_byte = [x / len(c.encode("utf-8")) for x, c in zip(ll, item["choices"])]
    right += int(np.argmax(ll)) == item["answer"]
    right_norm += int(np.argmax(per_byte)) == item["answer"]
    k += n
  acc, n = right / len(items), len(items)
  return {"items": n, "accuracy": acc, "accuracy_stderr": math.sqrt(acc * (1 - acc) / n),
          "accuracy_per_byte": right_norm / n}


def read_texts(files: Sequence[str]) -> list[str]:
  """The documents of text, .jsonl or .parquet files."""
  docs = []
  for path in files:
    fmt = {".jsonl": "jsonl", ".parquet": "parquet"}.get(os.path.splitext(path)[1], "text")
    docs += list(sources.read_documents(path, {"format": fmt, "separator": None,
                                               "text_field": "text", "column": "text"}))
  return docs


class Tasks:
  """Text and multiple-choice files, checked once (errors name `fields`), scored by `run`."""

  def __init__(self, text: Sequence[str], choices: Sequence[str],
               fields: tuple[str, str] = ("--text", "--choices")):
    self.files = sources.expand_paths(text, fields[0]) if text else []
    self.documents = read_texts(self.files)
    self.choices = {}
    for path in choices:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{fields[1]}: no file {path!r}")
      self.choices[path] = read_choices(path)

  def run(self, scorer: Scorer, tok) -> list[dict]:
    """One result a task: {"task": "text" or the JSONL path, and its scores}."""
    results = []
    if self.files:
      results.append({"task": "text", "files": len(self.files),
                      **text_scores(scorer, tok, self.documents)})
    for path, items in self.choices.items():
      results.append({"task": path, **choice_scores(scorer, tok, items)})
    return results


def as_scalars(results: Sequence[dict]) -> dict[str, float]:
  """`Tasks.run`'s results as metrics eval_<task>_<score>."""
  out = {}
  for r in results:
    name = "text" if r["task"] == "text" else os.path.splitext(os.path.basename(r["task"]))[0]
    for key in ("loss", "perplexity", "bits_per_byte", "accuracy", "accuracy_stderr",
                "accuracy_per_byte"):
      if key in r:
        out[f"eval_{name}_{key}"] = float(r[key])
  return out

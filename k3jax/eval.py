"""Scores of a checkpoint: perplexity and bits per byte on text, multiple-choice accuracy.

  python -m k3jax.eval --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny \
      --text="corpus/*.txt" --choices=tasks/mc.jsonl [--out=/tmp/eval.jsonl]

--text: files of documents (plain text, one document a file; `data.sources`' readers for
.jsonl / .parquet by extension): each document is [bos] + tokens + [eos], scored in
windows of train.seq_len + 1 tokens (each window from a fresh context); reported as the
mean loss per token, perplexity, and bits per byte (the summed loss in bits over the
documents' UTF-8 bytes).
--choices: JSONL items {"context": str, "choices": [str, ...], "answer": int} (the
lm-eval-harness convention): each choice's summed log-likelihood after [bos] + context;
accuracy (the likeliest choice), accuracy normalized by the choice's bytes, and the
standard error sqrt(acc (1 - acc) / n).
Results go to the console and, with --out, one JSON line per task.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from k3jax import checkpoint, cli, parallel, program
from k3jax import config as k3config
from k3jax import data as k3data
from k3jax.data import sources

_WORKDIR = flags.DEFINE_string("workdir", None, "the run (or weights) directory to read.")
_TEXT = flags.DEFINE_list("text", [], "glob patterns of text files to score.")
_CHOICES = flags.DEFINE_list("choices", [], "multiple-choice JSONL files.")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences scored at once.")
_OUT = flags.DEFINE_string("out", None, "append one JSON line of results per task here.")


class Scorer:
  """Log-likelihoods of token sequences under a model, `batch` rows of `length` at once."""

  def __init__(self, model, length: int, batch: int):
    graphdef, state = nnx.split(model)
    self.length, self.batch, self.state = length, batch, state

    @jax.jit
    def logprobs(state, tokens, segment_ids):     # [B, T] -> log p(token t + 1) [B, T - 1]
      logits, _ = nnx.merge(graphdef, state)(tokens, segment_ids)
      logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
      return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    self._logprobs = logprobs

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


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _WORKDIR.value or not (_TEXT.value or _CHOICES.value):
    raise app.UsageError("give --workdir and at least one of --text, --choices")
  cfg = cli.CONFIG.value
  prog = program.build_once(cfg, parallel.make_mesh(cfg.mesh))
  step, params, rest = checkpoint.restore_params(
      _WORKDIR.value, prog.abstract_state, config_json=cfg.to_json(),
      must_match=[f for f in k3config.RESTORE_FIELDS if f.startswith("model.")])
  scorer = Scorer(nnx.merge(prog.graphdef, params, rest), cfg.train.seq_len + 1, _BATCH.value)
  tok = k3data.make_tokenizer(cfg.data.tokenizer)
  results = []
  if _TEXT.value:
    files = sources.expand_paths(_TEXT.value, "--text")
    docs = []
    for path in files:
      fmt = {".jsonl": "jsonl", ".parquet": "parquet"}.get(os.path.splitext(path)[1], "text")
      docs += list(sources.read_documents(path, {"format": fmt, "separator": None,
                                                 "text_field": "text", "column": "text"}))
    results.append({"task": "text", "files": len(files), **text_scores(scorer, tok, docs)})
  for path in _CHOICES.value:
    results.append({"task": path, **choice_scores(scorer, tok, read_choices(path))})
  for r in results:
    r["step"] = step
    print(json.dumps(r), flush=True)
  if _OUT.value:
    with open(_OUT.value, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)

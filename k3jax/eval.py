"""Scores of a checkpoint: perplexity and bits per byte on text, multiple-choice accuracy.

  python -m k3jax.eval --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny \
      --text="corpus/*.txt" --choices=tasks/mc.jsonl [--out=/tmp/eval.jsonl]

--text: documents (text, .jsonl, .parquet) scored in windows of seq_len + 1: loss,
perplexity, bits per byte. --choices: JSONL {"context", "choices", "answer"}: accuracy,
byte-normalized accuracy, standard error. --out: one JSON line per task."""

from __future__ import annotations

import json

from absl import app, flags, logging

from k3jax import cli, program, scoring
from k3jax import data as k3data

_WORKDIR = flags.DEFINE_string("workdir", None, "the run (or weights) directory to read.")
_TEXT = flags.DEFINE_list("text", [], "glob patterns of text files to score.")
_CHOICES = flags.DEFINE_list("choices", [], "multiple-choice JSONL files.")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences scored at once.")
_OUT = flags.DEFINE_string("out", None, "append one JSON line of results per task here.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _WORKDIR.value or not (_TEXT.value or _CHOICES.value):
    raise app.UsageError("give --workdir and at least one of --text, --choices")
  cfg = cli.CONFIG.value
  tasks = scoring.Tasks(_TEXT.value, _CHOICES.value)
  step, model = program.restored_model(cfg, _WORKDIR.value)
  tok = k3data.make_tokenizer(cfg.data.tokenizer)
  results = tasks.run(scoring.Scorer(model, cfg.train.seq_len + 1, _BATCH.value), tok)
  for r in results:
    r["step"] = step
    print(json.dumps(r), flush=True)
  if _OUT.value:
    with open(_OUT.value, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)

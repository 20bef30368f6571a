"""k3_tiny's scores after the README's first command, on the embedded corpus's held-out
documents: bits per byte, and a multiple-choice task made from them.

  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny
  python benchmarks/k3_tiny_eval.py --workdir=/tmp/k3_tiny [--items=200]

The task: at a random place of a held-out document, the 64 characters before it are the
context; the true next 24 characters are one choice, 24 characters from 3 other places of
the held-out documents the others (seeded). Writes the files to a temporary directory and
runs `python -m k3jax.eval` on them; prints its JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3jax.data import corpus  # noqa: E402


def task(docs: list[str], items: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  docs = [d for d in docs if len(d) > 200]

  def place():
    d = docs[rng.integers(len(docs))]
    return d, int(rng.integers(64, len(d) - 24))

  out = []
  for _ in range(items):
    d, i = place()
    choices = [d[i:i + 24]] + [e[j:j + 24] for e, j in (place() for _ in range(3))]
    order = rng.permutation(4)
    out.append({"context": d[i - 64:i], "choices": [choices[k] for k in order],
                "answer": int(np.argmin(order))})
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/k3_tiny")
  parser.add_argument("--items", type=int, default=200)
  args = parser.parse_args()
  docs = corpus.default_documents("validation")
  with tempfile.TemporaryDirectory() as tmp:
    for i, d in enumerate(docs):
      with open(os.path.join(tmp, f"heldout_{i:03d}.txt"), "w") as f:
        f.write(d)
    with open(os.path.join(tmp, "mc.jsonl"), "w") as f:
      f.writelines(json.dumps(x) + "\n" for x in task(docs, args.items))
    subprocess.run([sys.executable, "-m", "k3jax.eval", "--config=experiments/k3_tiny.py",
                    f"--workdir={args.workdir}", f"--text={tmp}/heldout_*.txt",
                    f"--choices={tmp}/mc.jsonl"], check=True,
                   cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


if __name__ == "__main__":
  main()

"""Text from a k3jax checkpoint: prompts continued token by token (`k3jax.decode`).

  python -m k3jax.generate --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny \
      --prompt="The " --max_new_tokens=64 [--temperature=0.8 --top_k=40 --top_p=0.95 --seed=0]
  python -m k3jax.generate --config=... --workdir=... --prompts=FILE   # one prompt a line"""

from __future__ import annotations

import sys

import jax
from absl import app, flags, logging

from k3jax import cli, decode, program
from k3jax import data as k3data

_WORKDIR = flags.DEFINE_string("workdir", None, "the run (or weights) directory to read.")
_PROMPT = flags.DEFINE_string("prompt", None, "the text to continue.")
_PROMPTS = flags.DEFINE_string("prompts", None, "a file of prompts, one a line.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to add at most to each prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampled.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample among the k likeliest tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample within the likeliest tokens of this mass.")
_SEED = flags.DEFINE_integer("seed", 0, "the sampling seed.")


def read_prompts() -> list[str]:
  if (_PROMPT.value is None) == (_PROMPTS.value is None):
    raise app.UsageError("give --prompt or --prompts (one of them)")
  if _PROMPT.value is not None:
    return [_PROMPT.value]
  with open(_PROMPTS.value) as f:
    prompts = [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ValueError(f"{_PROMPTS.value}: no prompt in the file")
  return prompts


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  if _MAX_NEW.value < 0 or _TEMPERATURE.value < 0 or not 0 < _TOP_P.value <= 1:
    raise app.UsageError("--max_new_tokens and --temperature must be >= 0, --top_p in (0, 1]")
  cfg = cli.CONFIG.value
  prompts = read_prompts()
  step, model = program.restored_model(cfg, _WORKDIR.value)
  tok = k3data.make_tokenizer(cfg.data.tokenizer)
  ids = [[tok.bos_id, *tok.encode(p).tolist()] for p in prompts]
  print(f"# step {step} of {_WORKDIR.value}", file=sys.stderr, flush=True)
  stream = len(prompts) == 1
  new, shown = [], [0]

  def show(row, token):
    # the text of all new tokens so far, printed up to its last whole character
    if not stream:
      return
    new.append(token)
    text = tok.decode(new)
    whole = len(text.rstrip("\ufffd"))
    print(text[shown[0]:whole], end="", flush=True)
    shown[0] = max(shown[0], whole)

  if stream:
    print(prompts[0], end="", flush=True)
  out = decode.generate(model, ids, max_new_tokens=_MAX_NEW.value, eos_id=tok.eos_id,
                        key=jax.random.key(_SEED.value), temperature=_TEMPERATURE.value,
                        top_k=_TOP_K.value, top_p=_TOP_P.value, on_token=show)
  if stream:
    print(flush=True)
  else:
    for prompt, new in zip(prompts, out):
      print(prompt + tok.decode(new), flush=True)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)

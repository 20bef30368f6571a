"""k3jax.scoring and python -m k3jax.eval: text scores and multiple-choice accuracy against
the model's own log-softmax, the task file's errors, and the command on a checkpoint."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config, random_model
from flax import nnx

from k3jax import data as k3data
from k3jax import scoring as k3eval
from k3jax.model import K3Model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def scored():
  c = micro_config()
  c.model.vocab_size = 384                       # the byte tokenizer's 258 ids fit
  c.model.moe.dispatch = "dropless"              # routing that does not depend on row length
  # Matrices at a quarter of random_model's scale (as in test_model.py): at full scale the
  # random 13 layers amplify fp32 rounding to ~1e-3 in a token's log-prob between the
  # scorer's padded batch and one row, which host CPUs round differently.
  graphdef, params, rest = nnx.split(random_model(c.model, model_cls=K3Model), nnx.Param, ...)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (0.25 * x if x.ndim >= 2 and "embed" not in jax.tree_util.keystr(path)
                       else x), params)
  model = nnx.merge(graphdef, params, rest)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, jnp.ones_like(t))[0])

  def logp(ids):                                  # log p(token t + 1 | ...) of one sequence
    lp = jax.nn.log_softmax(forward(state, jnp.asarray([ids]))[0, :-1], axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(ids[1:])[:, None], -1)[:, 0])

  tok = k3data.make_tokenizer(c.data.tokenizer)
  return k3eval.Scorer(model, c.train.seq_len + 1, 4), tok, logp


def test_text_scores_are_the_models_token_losses(scored):
  """A short document (one window) and a 70-byte one (3 windows of seq_len 32 + 1 tokens,
  each from a fresh context): the summed loss, perplexity and bits per byte from the
  forward's own log-softmax over [bos] + bytes + [eos]."""
  scorer, tok, logp = scored
  docs = ["hello k3", "x" * 30 + "y" * 40]
  nll, n = 0.0, 0
  for d in docs:
    ids = [tok.bos_id, *tok.encode(d).tolist(), tok.eos_id]
    for i in range(0, len(ids) - 1, 32):
      lp = logp(ids[i:i + 33])
      nll, n = nll - float(lp.sum()), n + len(lp)
  got = k3eval.text_scores(scorer, tok, docs)
  assert got["tokens"] == n == 9 + 32 + 32 + 7
  np.testing.assert_allclose(got["loss"], nll / n, rtol=1e-5)
  np.testing.assert_allclose(got["perplexity"], math.exp(got["loss"]), rtol=1e-12)
  np.testing.assert_allclose(got["bits_per_byte"], nll / math.log(2) / 78, rtol=1e-5)


def test_choices_pick_the_likeliest_continuation(scored):
  """Items whose answer is the choice the model finds likeliest (from its log-softmax)
  score 1.0; answers moved to another choice score 0.0; the standard error is
  sqrt(acc (1 - acc) / n)."""
  scorer, tok, logp = scored
  items = []
  for ctx, choices in [("ab", ["c", "dd", "e"]), ("the ", ["cat", "dog"]), ("1+1=", ["2", "3"])]:
    base = [tok.bos_id, *tok.encode(ctx).tolist()]
    ll = [float(logp(base + tok.encode(ch).tolist())[-len(ch):].sum()) for ch in choices]
    items.append({"context": ctx, "choices": choices, "answer": int(np.argmax(ll))})
  got = k3eval.choice_scores(scorer, tok, items)
  assert got["items"] == 3 and got["accuracy"] == 1.0 and got["accuracy_stderr"] == 0.0
  wrong = [{**it, "answer": (it["answer"] + 1) % len(it["choices"])} for it in items]
  assert k3eval.choice_scores(scorer, tok, wrong)["accuracy"] == 0.0
  mixed = k3eval.choice_scores(scorer, tok, items[:2] + wrong[2:])
  np.testing.assert_allclose(mixed["accuracy_stderr"], math.sqrt(2 / 3 * 1 / 3 / 3))


@pytest.mark.parametrize("line, match", [
    ('{"context": "a", "choices": ["b"], "answer": 0}', "m.jsonl:2: need"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}', "m.jsonl:2: need"),
    ("not json", "m.jsonl:2: need"),
])
def test_bad_task_files_name_the_line(tmp_path, line, match):
  path = tmp_path / "m.jsonl"
  path.write_text('{"context": "a", "choices": ["b", "c"], "answer": 1}\n' + line + "\n")
  with pytest.raises(ValueError, match=match):
    k3eval.read_choices(str(path))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="empty.jsonl: no item"):
    k3eval.read_choices(str(tmp_path / "empty.jsonl"))


def test_eval_command_reports_each_task(tmp_path):
  """`python -m k3jax.eval` on a k3_tiny weights checkpoint: one JSON line per task, on
  the console and appended to --out."""
  from k3jax import parallel, program  # noqa: PLC0415
  from k3jax.convert import importer  # noqa: PLC0415
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import k3_tiny  # noqa: PLC0415
  cfg = k3_tiny.get_config()
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh))
  rng = np.random.default_rng(0)
  params, rest = jax.tree.map(lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape),
                                                    a.dtype), prog.abstract_state[:2])
  importer.write_weights(str(tmp_path / "w"), params, rest, cfg.to_json())
  (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
  (tmp_path / "mc.jsonl").write_text(json.dumps(
      {"context": "The quick brown ", "choices": ["fox", "cat"], "answer": 0}) + "\n")
  run = subprocess.run(
      [sys.executable, "-m", "k3jax.eval", "--config=experiments/k3_tiny.py",
       f"--workdir={tmp_path / 'w'}", f"--text={tmp_path / '*.txt'}",
       f"--choices={tmp_path / 'mc.jsonl'}", f"--out={tmp_path / 'r.jsonl'}"],
      cwd=ROOT, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
  assert [r["task"] for r in lines] == ["text", str(tmp_path / "mc.jsonl")]
  assert lines[0]["bits_per_byte"] > 0 and lines[1]["items"] == 1 and lines[0]["step"] == 0
  assert [json.loads(x) for x in open(tmp_path / "r.jsonl")] == lines

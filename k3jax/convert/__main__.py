"""Import the released Kimi K3 into k3jax, or export k3jax weights in its layout.

  python -m k3jax.convert import --hf_dir=DIR --workdir=WD --config=experiments/k3_full.py
  python -m k3jax.train --config=experiments/k3_full.py --workdir=RUN \
      --config.train.init_from=WD        # step 0 from the release, fresh optimizer state
  python -m k3jax.convert export --workdir=RUN --out=DIR --config=experiments/k3_full.py"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import app, flags, logging

from k3jax import checkpoint, cli, parallel, program
from k3jax import config as k3config
from k3jax.convert import exporter, hf_config, importer
from k3jax.parallel import distributed

_HF_DIR = flags.DEFINE_string("hf_dir", None, "import: the release's directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "import: where the weights checkpoint goes; "
                               "export: the run (or weights) directory to read.")
_OUT = flags.DEFINE_string("out", None, "export: the directory to write.")


def say(msg: str):
  if jax.process_index() == 0:
    print(msg, flush=True)


def import_release(cfg, hf_dir: str, workdir: str) -> None:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{hf_dir}: no config.json")
  with open(path) as f:
    hf_config.apply(cfg, json.load(f))
  k3config.validate(cfg)
  prog = program.build_once(cfg, parallel.make_mesh(cfg.mesh))
  params, rest = importer.load_release(hf_dir, cfg.model, prog.abstract_state[:2], log=say)
  importer.write_weights(workdir, params, rest, cfg.to_json())
  say(f"import: wrote {workdir}; train from it with --config.train.init_from={workdir}")


def export_release(cfg, workdir: str, out: str) -> None:
  if jax.process_count() > 1:
    raise ValueError("export runs on one process (it gathers each layer to the host)")
  prog = program.build_once(cfg, parallel.make_mesh(cfg.mesh))
  step, params, rest = checkpoint.restore_params(
      workdir, prog.abstract_state, config_json=cfg.to_json(),
      must_match=k3config.MODEL_RESTORE_FIELDS, field="--workdir")
  flat = {}
  for tree in (params, rest):
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      flat[importer.param_path(keys)] = leaf

  def param(path, c):
    leaf = flat[path] if c is None else flat[path][c]
    return np.asarray(jax.device_get(leaf), np.float32)

  nbytes = exporter.export_release(cfg.model, param, out, log=say)
  say(f"export: step {step} of {workdir} -> {out} ({nbytes / 2**30:.2f} GiB)")


def main(argv):
  if len(argv) != 2 or argv[1] not in ("import", "export"):
    raise app.UsageError("python -m k3jax.convert import|export --config=... (see --help)")
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  cfg = cli.CONFIG.value
  if argv[1] == "import":
    if not (_HF_DIR.value and _WORKDIR.value):
      raise app.UsageError("import needs --hf_dir and --workdir")
    import_release(cfg, _HF_DIR.value, _WORKDIR.value)
  else:
    if not (_WORKDIR.value and _OUT.value):
      raise app.UsageError("export needs --workdir and --out")
    export_release(cfg, _WORKDIR.value, _OUT.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)

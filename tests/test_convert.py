"""python -m k3jax.convert, end to end on a release-layout checkpoint of k3_tiny's shape
(written by the exporter from random weights, MXFP4 experts, a vision tensor the text
import skips): import -> a weights checkpoint -> `k3jax.train` starts from it -> export
gives back every bf16/fp32 tensor byte for byte and the MXFP4 experts value for value, and
the same config; damaged directories are refused naming the tensor and file."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from k3jax.convert import exporter, importer, layout
from k3jax.convert import safetensors as st
from k3jax.model import mxfp4
from k3jax.model.k3 import K3Model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ["--config=experiments/k3_tiny.py", "--config.model.kda.gate_rank=32"]


def tiny_model(variant=None):
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import k3_tiny  # noqa: PLC0415
  m = k3_tiny.get_config(variant).model
  m.kda.gate_rank = 32
  return m


def write_release(path, m):
  """A release directory of random parameters of model config `m`, by the exporter."""
  state = nnx.state(nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  params = {}
  for keys, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    params[importer.param_path(keys).removesuffix("/.value")] = (
        0.1 * rng.standard_normal(leaf.shape).astype(np.float32))
  exporter.export_release(m, lambda p, c: params[p] if c is None else params[p][c], path,
                          log=lambda msg: None)


def release_dir(path):
  """A text model's release, plus one vision tensor a text-only import must skip."""
  m = tiny_model()
  write_release(path, m)
  vision = os.path.join(path, "model-vision.safetensors")
  st.write(vision, {"vision_tower.encoder.final_layernorm.weight": np.ones(8, ml_dtypes.bfloat16)})
  index = json.load(open(os.path.join(path, st.INDEX)))
  index["weight_map"]["vision_tower.encoder.final_layernorm.weight"] = "model-vision.safetensors"
  json.dump(index, open(os.path.join(path, st.INDEX), "w"))
  return m


def run(*args, check=True):
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if check and out.returncode:
    raise AssertionError(out.stdout + out.stderr)
  return out


def tensors(path):
  infos = {}
  for file in sorted(set(st.read_index(path).values())):
    infos.update(st.read_header(file)[0])
  return infos


def test_import_train_export(tmp_path):
  hf, weights, runs, out = (str(tmp_path / n) for n in ("hf", "weights", "run", "out"))
  m = release_dir(hf)
  got = run("k3jax.convert", "import", f"--hf_dir={hf}", f"--workdir={weights}", *CONFIG)
  assert "1 vision tower / projector tensors not read" in got.stdout
  got = run("k3jax.train", *CONFIG, f"--workdir={runs}", f"--config.train.init_from={weights}",
            "--config.train.steps=2", "--config.train.log_every=1",
            "--config.optimizer.warmup_steps=1")
  assert f"init: parameters from {weights}" in got.stdout + got.stderr
  losses = [json.loads(line)["loss"] for line in open(os.path.join(runs, "metrics.jsonl"))
            if '"loss"' in line]
  assert len(losses) == 2 and np.isfinite(losses).all()

  run("k3jax.convert", "export", f"--workdir={weights}", f"--out={out}", *CONFIG)
  same_release(hf, out, m)
  assert json.load(open(os.path.join(out, "config.json"))) == json.load(
      open(os.path.join(hf, "config.json")))


def same_release(hf, out, m):
  """The release tensors of `out` are those of `hf`: bf16 / fp32 bytes, MXFP4 values."""
  before, after = tensors(hf), tensors(out)
  before.pop("vision_tower.encoder.final_layernorm.weight", None)
  assert set(before) == set(after) == set(layout.expected(m))
  for name, info in before.items():
    if name.endswith("weight_packed"):
      scale = name.replace("_packed", "_scale")
      np.testing.assert_array_equal(
          mxfp4.dequantize(st.read(after[name]), st.read(after[scale])),
          mxfp4.dequantize(st.read(info), st.read(before[scale])))
    elif not name.endswith("weight_scale"):
      assert st.read(after[name]).tobytes() == st.read(info).tobytes(), name


def test_two_processes_import_what_one_process_exports(tmp_path):
  """The import on 2 processes x 4 CPU devices (launch.local, jax.distributed), parameters
  split over fsdp 4 x expert 2 so each process assembles only its devices' rows: the
  weights checkpoint they write exports, from one process, to the release's tensors."""
  hf, weights, out = (str(tmp_path / n) for n in ("hf", "weights", "out"))
  m = release_dir(hf)
  got = run("launch.local", "--processes=2", "--devices_per_process=4",
            "--module=k3jax.convert", "--", "import", f"--hf_dir={hf}", f"--workdir={weights}",
            *CONFIG, "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.expert=2")
  assert f"import: wrote {weights}" in got.stdout
  run("k3jax.convert", "export", f"--workdir={weights}", f"--out={out}", *CONFIG)
  same_release(hf, out, m)


def test_import_export_with_the_tower(tmp_path):
  """k3_tiny:multimodal's tower and projector in the release's layout (vision_config, the
  vision shard): imported with the text model and exported to the same bytes and config."""
  hf, weights, out = (str(tmp_path / n) for n in ("hf", "weights", "out"))
  m = tiny_model("multimodal")
  write_release(hf, m)
  config = [f"{CONFIG[0]}:multimodal", *CONFIG[1:]]
  got = run("k3jax.convert", "import", f"--hf_dir={hf}", f"--workdir={weights}", *config)
  assert "not read" not in got.stdout
  run("k3jax.convert", "export", f"--workdir={weights}", f"--out={out}", *config)
  before, after = tensors(hf), tensors(out)
  vision = {n for n in before if n.startswith(("vision_tower.", "mm_projector."))}
  assert len(vision) == 6 + 6 * m.vision.num_layers and set(before) == set(after)
  for name in vision:
    assert st.read(after[name]).tobytes() == st.read(before[name]).tobytes(), name
  written = json.load(open(os.path.join(hf, "config.json")))
  assert written["vision_config"]["vt_hidden_size"] == m.vision.width
  assert json.load(open(os.path.join(out, "config.json"))) == written


def damage(hf, how):
  index = json.load(open(os.path.join(hf, st.INDEX)))
  first = os.path.join(hf, exporter.shard_name(1, 10))
  if how == "missing shard":
    os.remove(os.path.join(hf, exporter.shard_name(2, 10)))
  elif how == "truncated":
    data = open(first, "rb").read()
    open(first, "wb").write(data[:-100])
  elif how in ("wrong shape", "unknown name"):
    tensors = {n: st.read(i) for n, i in st.read_header(first)[0].items()}
    if how == "wrong shape":
      key = "language_model.model.layers.0.input_layernorm.weight"
      tensors[key] = tensors[key][:64]
    else:
      tensors["language_model.model.layers.0.extra.weight"] = np.ones(4, np.float32)
      index["weight_map"]["language_model.model.layers.0.extra.weight"] = exporter.shard_name(1, 10)
    st.write(first, tensors)
  elif how == "bad config":
    config = json.load(open(os.path.join(hf, "config.json")))
    config["text_config"]["num_expert_group"] = 4
    json.dump(config, open(os.path.join(hf, "config.json"), "w"))
  json.dump(index, open(os.path.join(hf, st.INDEX), "w"))


@pytest.mark.parametrize("how, match", [
    ("missing shard", "names model-00002-of-000010.safetensors, which is missing"),
    ("truncated", r"model-00001-of-000010.safetensors: tensor .* \(truncated\)"),
    ("wrong shape", "'language_model.model.layers.0.input_layernorm.weight' is BF16 \\[64\\]; "
                    "the model reads BF16 \\[128\\]"),
    ("unknown name", "'language_model.model.layers.0.extra.weight' is not part of a K3"),
    ("bad config", "text_config.num_expert_group: 4"),
])
def test_damaged_releases_are_refused_and_nothing_is_written(tmp_path, how, match):
  hf, weights = str(tmp_path / "hf"), str(tmp_path / "weights")
  release_dir(hf)
  damage(hf, how)
  got = run("k3jax.convert", "import", f"--hf_dir={hf}", f"--workdir={weights}", *CONFIG,
            check=False)
  assert got.returncode != 0
  import re  # noqa: PLC0415
  assert re.search(match, got.stderr), got.stderr[-2000:]
  assert not os.path.exists(os.path.join(weights, "checkpoints", "0"))

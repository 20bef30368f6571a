"""The released Kimi K3's weights (a Hugging Face directory) as k3jax parameters.

`load_release` checks every tensor's presence, dtype and shape, then assembles the
parameters per process (`stream.assemble`); the vision tower only with
`model.vision.enabled`. `write_weights` writes a checkpoint for `train.init_from`."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import jax

from k3jax import checkpoint
from k3jax.convert import layout, safetensors, stream
from k3jax.convert.safetensors import FormatError

NOT_READ = ("vision_tower.", "mm_projector.")
IMPORT_THREADS = 4


def read_headers(hf_dir: str) -> dict[str, safetensors.TensorInfo]:
  """name -> TensorInfo of every tensor, checked against the index."""
  files = safetensors.read_index(hf_dir)
  infos: dict[str, safetensors.TensorInfo] = {}
  for file in sorted(set(files.values())):
    for name, info in safetensors.read_header(file)[0].items():
      if files.get(name, file) != file:
        raise FormatError(f"{file}: holds {name!r}, which the index places in {files[name]}")
      infos[name] = info
  for name, file in files.items():
    if name not in infos:
      raise FormatError(f"{file}: the index places {name!r} here, but the file lacks it")
  return infos


def check_tensors(m, infos: dict[str, safetensors.TensorInfo], hf_dir: str) -> None:
  """FormatError naming the first missing, mismatched or unknown tensor."""
  want = layout.expected(m)
  for name, (dtype, shape) in want.items():
    info = infos.get(name)
    if info is None:
      raise FormatError(f"{hf_dir}: tensor {name!r} is missing (a K3 text model of this "
                        f"config reads it)")
    if info.dtype != dtype or info.shape != tuple(shape):
      raise FormatError(f"{info.file}: tensor {name!r} is {safetensors.NAMES[info.dtype]} "
                        f"{list(info.shape)}; the model reads {safetensors.NAMES[dtype]} "
                        f"{list(shape)}")
  skip = () if m.vision.enabled else NOT_READ
  unknown = sorted(n for n in infos if n not in want and not n.startswith(skip))
  if unknown:
    raise FormatError(f"{infos[unknown[0]].file}: tensor {unknown[0]!r} is not part of a K3 "
                      f"text model of this config ({len(unknown)} such tensors)")


def param_path(keys) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def load_release(hf_dir: str, m, abstract: tuple, log: Callable[[str], None] = print):
  """(params, rest) of model `m` from the release, into `abstract`'s shardings."""
  infos = read_headers(hf_dir)
  check_tensors(m, infos, hf_dir)
  skipped = 0 if m.vision.enabled else sum(n.startswith(NOT_READ) for n in infos)
  if skipped:
    log(f"import: {skipped} vision tower / projector tensors not read (text model only)")

  def release(name: str) -> stream.Source:
    if name.endswith(".weight_packed"):
      return stream.from_mxfp4(infos[name], infos[name.removesuffix("_packed") + "_scale"])
    return stream.from_file(infos[name])

  sources = layout.sources(m, release)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  progress = stream.Progress(total, log=lambda msg: log(f"import: {msg}"))
  # several arrays at a time: copies and device puts release the GIL
  with concurrent.futures.ThreadPoolExecutor(IMPORT_THREADS) as pool:
    futures = tuple(jax.tree_util.tree_map_with_path(
        lambda keys, a: pool.submit(stream.assemble, a, sources[param_path(keys)], progress),
        tree) for tree in abstract)
    return tuple(jax.tree.map(lambda f: f.result(), tree) for tree in futures)


def write_weights(directory: str, params, rest, config_json: str) -> None:
  """A weights checkpoint: step 0 holding (params, rest) and the config."""
  ckpt = checkpoint.Checkpointer(directory, keep=1)
  ckpt.save(0, (params, rest), None, config_json, force=True)
  ckpt.close()

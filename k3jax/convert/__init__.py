"""Hugging Face checkpoints of the released Kimi K3 in and out of k3jax (issue 29):
`python -m k3jax.convert import|export` (`__main__.py`).

  safetensors.py   the safetensors file format: headers, byte-range reads, streaming writes,
                   the shard index
  hf_config.py     the release's config.json <-> k3jax's model config (refusing what k3jax
                   cannot express)
  layout.py        each text-model parameter <-> the release's tensors (names, dtypes,
                   transposes, fused shared experts, padded A_log, reversed conv taps, MXFP4)
  importer.py      a release directory checked and assembled as k3jax (params, rest); the
                   weights checkpoint `train.init_from` starts from
  exporter.py      k3jax parameters written as a release directory
  stream.py        sharded arrays assembled from reads of only each process's boxes:
                   sources for file tensors, MXFP4 weights, stacked layers, torch layouts
"""

"""Hugging Face checkpoints of the released Kimi K3 in and out of k3jax (issue 29):
`python -m k3jax.convert import|export` (`__main__.py`).

  safetensors.py   the file format: byte-range reads, streaming writes, the index
  hf_config.py     config.json <-> k3jax's model config
  layout.py        text-model parameters <-> release tensors
  importer.py      a release directory as k3jax (params, rest), a weights checkpoint
  exporter.py      k3jax parameters as a release directory
  stream.py        sharded arrays from per-process reads"""

"""The full K3 model: 93 layers, d 7168, 896 experts top-16, 2.78T parameters.

  python -m k3jax.params --config=experiments/k3_full.py
  python -m k3jax.train --config=experiments/k3_full.py --workdir=gs://...

Every value is the default of `k3jax.config.base_config()` (K3_SPEC section 1), with the
MoonViT-V2 vision tower (K3_SPEC 6: 27 layers, width 1024, 401M + a 29M projector) built.
"""

from k3jax import config as k3config


def get_config(arg: str | None = None):
  del arg
  c = k3config.base_config()
  c.model.vision.enabled = True
  c.data.worker_count = 8  # per training process: pieces read ahead of packing
  # TPU: the dropless dispatch per device (plain "dropless" is left unpartitioned by XLA:
  # every device would run every token's experts); GPU: capacity buffers
  c.model.moe.dispatch = "auto"
  return c

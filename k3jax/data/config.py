"""The `data` section: `data_config()`, `check_config` (ValueError; reads no file) and
`validate_data` (ConfigError)."""

from __future__ import annotations

import ml_collections

from k3jax.config_error import ConfigError
from k3jax.data import images as images_lib
from k3jax.data import sources as sources_lib
from k3jax.data.tokenizer import check_tokenizer_config, tokenizer_config

# "default": the embedded corpus (k3jax/data/corpus.py); "files": config.data.sources.
SOURCES = ("default", "files", "none")   # "none": no text (data.images must be on)
# "first_fit": whole pieces, the rest padded; "concat_then_split": no padding, pieces cut
# at row ends continue as new segments.
PACKINGS = ("first_fit", "concat_then_split")


def data_config() -> ml_collections.ConfigDict:
  """Defaults of the `data` section (sources: k3jax/data/sources.py)."""
  c = ml_collections.ConfigDict()
  c.source = "default"      # one of SOURCES
  c.packing = "first_fit"   # one of PACKINGS
  c.sources = ()            # source="files": dicts, fields in k3jax/data/sources.py
  # source="files": document i is held out when i % heldout_every == 0 (0: none)
  c.heldout_every = 20
  c.tokenizer = tokenizer_config()
  # Worker processes reading training pieces (0: in-process); batches don't depend on it
  c.worker_count = 0
  c.worker_buffer_size = 2
  c.images = images_lib.images_config()   # image-text examples (k3jax/data/images.py)
  return c


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field of the `data` section (reads no file)."""
  if cfg.source not in SOURCES:
    raise ValueError(f"config.data.source must be one of {SOURCES}, got {cfg.source!r}")
  if cfg.packing not in PACKINGS:
    raise ValueError(f"config.data.packing must be one of {PACKINGS}, got {cfg.packing!r}")
  check_tokenizer_config(cfg.tokenizer)
  if not isinstance(cfg.heldout_every, int) or cfg.heldout_every < 0:
    raise ValueError(f"config.data.heldout_every must be an integer >= 0, "
                     f"got {cfg.heldout_every!r}")
  for field, low in (("worker_count", 0), ("worker_buffer_size", 1)):
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"config.data.{field} must be an integer >= {low}, got {value!r}")
  images_lib.check_images_config(cfg.images)
  if cfg.source == "none" and cfg.images.source == "none":
    raise ValueError("config.data.source: 'none' (no text) needs config.data.images.source")
  if cfg.images.source != "none" and cfg.packing != "first_fit":
    raise ValueError(f"config.data.packing: image-text examples need 'first_fit' (an example "
                     f"is never cut), got {cfg.packing!r}")
  if cfg.source == "files" and not cfg.sources:
    raise ValueError("config.data.sources: source='files' needs at least one entry "
                     "(dict(paths=..., format=...))")
  if cfg.source != "files" and cfg.sources:
    raise ValueError(f"config.data.sources is set but config.data.source is {cfg.source!r}; "
                     f"set it to 'files'")
  for i, entry in enumerate(cfg.sources):
    sources_lib.source_spec(entry, i)


def validate_data(cfg: ml_collections.ConfigDict) -> None:
  """`check_config`, its ValueError raised as a ConfigError."""
  try:
    check_config(cfg)
  except ValueError as e:
    raise ConfigError(str(e)) from None

"""k3jax parameters as a Hugging Face directory in the released Kimi K3's layout: config.json,
one safetensors shard per layer, then globals and vision, each appearing when complete."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from k3jax.convert import hf_config, layout, safetensors


def shard_name(k: int, n: int) -> str:
  """The release's shard file names (its total has six digits)."""
  return f"model-{k:05d}-of-{n:06d}.safetensors"


def export_release(m, param: Callable[[str, int | None], np.ndarray], out_dir: str,
                   log: Callable[[str], None] = print) -> int:
  """Writes model `m` from `param(path, c)` to `out_dir`; returns the tensor bytes."""
  os.makedirs(out_dir, exist_ok=True)
  groups = list(layout.groups(m))
  weight_map, total = {}, 0
  for k, (label, pairs) in enumerate(groups, start=1):
    name = shard_name(k, len(groups))
    arrays = [(n, a) for rule, c in pairs
              for n, a in zip(rule.names, rule.save([param(p, c) for p in rule.paths]))]
    total += safetensors.write(os.path.join(out_dir, name), dict(arrays),
                               metadata={"format": "pt"})
    weight_map.update({n: name for n, _ in arrays})
    log(f"export: {label} -> {name}")
  config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "tie_word_embeddings": False, "dtype": "bfloat16",
            "text_config": hf_config.text_config(m)}
  if m.vision.enabled:
    config.update(vision_config=hf_config.vision_config(m),
                  media_placeholder_token_id=m.vision.placeholder_id)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  safetensors.write_index(out_dir, weight_map, total)
  return total

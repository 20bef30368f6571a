"""Count the parameters of a config without allocating them.

  python -m k3jax.params --config=experiments/k3_full.py

Prints a per-component table, then JSON {"total": N, "active": N}; active counts top_k /
num_experts of the routed weights and leaves out the input embedding and vision tower."""

from __future__ import annotations

import collections
import json
import math

from flax import nnx

from k3jax import cli
from k3jax import config as k3config
from k3jax.model import K3Model
from k3jax.model.attn_res import AttnResQuery
from k3jax.model.kda import KDA
from k3jax.model.latent_moe import LatentMoE
from k3jax.model.mla import MLA
from k3jax.model.situ_glu import GLUMLP
from k3jax.model.vision import Projector, VisionTower


# Innermost module type -> component name (order: most specific first).
_COMPONENTS = ((LatentMoE, "moe"), (GLUMLP, "dense_ffn"), (KDA, "kda"), (MLA, "mla"),
               (AttnResQuery, "attn_res"), (Projector, "vision_projector"),
               (VisionTower, "vision_tower"))


def abstract_model(cfg) -> K3Model:
  """The model with every array a ShapeDtypeStruct: nothing is allocated."""
  return nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))


def _axes(param) -> tuple:
  names = tuple(param.get_metadata().get("out_sharding") or ())
  return names[1:] if names[:1] == ("layers",) else names


def count(cfg) -> tuple[dict[str, int], int, int]:
  """(per-component counts, total, active) for `cfg` (a full experiment config)."""
  model = abstract_model(cfg)
  owners: dict[tuple, str] = {}
  for path, node in nnx.iter_graph(model):
    for cls, name in _COMPONENTS:
      if isinstance(node, cls):
        owners.setdefault(tuple(path), name)
        break
  rows: collections.Counter = collections.Counter()
  active = 0.0
  moe = cfg.model.moe
  for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(param.get_value().shape)
    owner = next((owners[path[:i]] for i in range(len(path), 0, -1) if path[:i] in owners),
                 None)
    if owner is None:
      owner = {"embed": "embedding", "lm_head": "lm_head"}.get(path[0], "norms")
    if owner == "moe":
      routed = _axes(param)[:1] == ("experts",)  # stacked expert weights [E, ...]
      owner = "moe_routed_experts" if routed else "moe_router_latent_shared"
    if owner == "moe_routed_experts":
      active += n * moe.top_k / moe.num_experts
    elif owner not in ("embedding", "vision_tower", "vision_projector"):
      active += n
    rows[owner] += n
  return dict(rows), sum(rows.values()), int(round(active))


def table(rows: dict[str, int], total: int, active: int) -> str:
  """The per-component table, largest first, then total and active."""
  body = [(name, f"{n:,}", f"{n / total:.2%}")
          for name, n in sorted(rows.items(), key=lambda kv: -kv[1])]
  lines = [("component", "parameters", "share"), *body,
           ("total", f"{total:,}", ""), ("active", f"{active:,}", "")]
  widths = [max(len(line[i]) for line in lines) for i in range(3)]
  return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}".rstrip()
                   for a, b, c in lines)


def main(argv):
  del argv
  cfg = k3config.validate(cli.CONFIG.value)
  rows, total, active = count(cfg)
  print(table(rows, total, active))
  print(json.dumps({"total": total, "active": active}))


if __name__ == "__main__":
  cli.run(main)

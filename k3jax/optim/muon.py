"""Per-head Muon (K3_SPEC 5): momentum, Newton-Schulz per block, RMS-matched scale.

    M <- 0.95 M + G;  O = NS5(G + 0.95 M or M) per block;
    update = -lr (0.2 sqrt(max(fan_in, fan_out)) O + wd W)

Blocks [*batch, fan_in, fan_out] come from each parameter's axis roles (`k3jax.model.layers`),
never names; parameters without them (and the router unless `muon.router == "muon"`) get AdamW.
The blocks of all parameters are orthogonalized together, a call per shape (`orthogonalize.py`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from k3jax.axes import STACKED_AXES, axis_names, is_variable
from k3jax.optim.orthogonalize import orthogonalize_all
from pallas_kernels.newton_schulz import newton_schulz

@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """How one parameter of `shape` maps to a batch of [fan_in, fan_out] Muon blocks."""
  shape: tuple[int, ...]
  perm: tuple[int, ...]       # axis order (batch..., in..., out...)
  batch: tuple[int, ...]
  fan_in: int
  fan_out: int

  @property
  def scale(self) -> float:
    """sqrt(max(fan_in, fan_out)); the update is rms_scale (0.2) times this times NS(U)."""
    return math.sqrt(max(self.fan_in, self.fan_out))

  def to_blocks(self, x: jax.Array) -> jax.Array:
    """[*shape] -> [*batch, fan_in, fan_out]."""
    return jnp.transpose(x, self.perm).reshape(*self.batch, self.fan_in, self.fan_out)

  def from_blocks(self, y: jax.Array) -> jax.Array:
    """[*batch, fan_in, fan_out] -> [*shape]."""
    permuted = tuple(self.shape[a] for a in self.perm)
    return jnp.transpose(y.reshape(permuted), _inverse(self.perm))

  def block_spec(self, spec: PartitionSpec) -> PartitionSpec:
    """The blocks' sharding for a parameter sharded as `spec` (batch axes keep theirs)."""
    spec = tuple(spec) + (None,) * (len(self.shape) - len(spec))
    nb = len(self.batch)
    ins, outs, size = [], list(self.perm[nb:]), 1
    while size < self.fan_in:  # the in-axes lead the fan axes in perm
      ins.append(outs.pop(0))
      size *= self.shape[ins[-1]]
    merged = [spec[f[0]] if f and all(spec[a] is None for a in f[1:]) else None
              for f in (ins, outs)]
    return PartitionSpec(*(spec[a] for a in self.perm[:nb]), *merged)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
  inv = [0] * len(perm)
  for i, p in enumerate(perm):
    inv[p] = i
  return tuple(inv)


def block_layout(var: nnx.Variable, *, per_head: bool) -> BlockLayout | None:
  """The Muon block layout of a parameter, or None if it is not a Muon matrix."""
  roles = var.get_metadata().get("muon_roles")
  if not var.get_metadata().get("muon") or roles is None:
    return None
  names = axis_names(var)
  shape = tuple(var.shape)
  stacked = [i for i, n in enumerate(names) if n in STACKED_AXES]
  own = [i for i in range(len(shape)) if i not in stacked]
  if len(own) != len(roles):
    raise ValueError(f"parameter of shape {shape} (axes {names}) has Muon roles {roles}: "
                     "one role per axis that is not a stacked layer axis")
  head_role = "batch" if per_head else "out"
  role = dict(zip(own, (head_role if r == "head" else "batch" if r == "expert" else r
                        for r in roles)))
  role.update({i: "batch" for i in stacked})
  batch = tuple(i for i in range(len(shape)) if role[i] == "batch")
  ins = tuple(i for i in range(len(shape)) if role[i] == "in")
  outs = tuple(i for i in range(len(shape)) if role[i] == "out")
  return BlockLayout(shape=shape, perm=batch + ins + outs,
                     batch=tuple(shape[i] for i in batch),
                     fan_in=math.prod(shape[i] for i in ins),
                     fan_out=math.prod(shape[i] for i in outs))


def muon_labels(params: Any, *, router: str = "adamw") -> Any:
  """'muon' or 'adamw' per leaf of `nnx.as_pure(params)`."""
  def label(var):
    kind = var.get_metadata().get("muon")
    if kind == "matrix" or (kind == "router" and router == "muon"):
      return "muon"
    return "adamw"

  return jax.tree.map(label, params, is_leaf=is_variable)


def block_layouts(params: Any, *, per_head: bool) -> Any:
  """BlockLayout (or None) per leaf of the pure state, from the parameters' metadata."""
  return jax.tree.map(lambda v: block_layout(v, per_head=per_head), params, is_leaf=is_variable)


class MuonState(NamedTuple):
  momentum: Any   # like the Muon parameters, float32


def scale_by_muon(layouts: Any, *, beta: float = 0.95, nesterov: bool = True,
                  ns_steps: int = 5, ns_coeffs: tuple[float, float, float] =
                  (3.4445, -4.7750, 2.0315), rms_scale: float = 0.2, eps: float = 1e-7,
                  ns_dtype: Any = jnp.bfloat16, ns_backend: str = "auto",
                  ns_gpu_iterate: str = "fp16", group_bytes: int = 0,
                  mesh: Mesh | None = None, specs: Any = None
                  ) -> optax.GradientTransformation:
  """Muon's direction: momentum, per-block Newton-Schulz, 0.2 sqrt(max fan) per block.
  layouts: a BlockLayout per leaf. group_bytes: `orthogonalize_all`'s. mesh, specs:
  Newton-Schulz then runs under `shard_map`, blocks split inside regrouped by an all-to-all.
  Returns the update before lr and wd."""
  def init(params):
    return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  ns = functools.partial(newton_schulz, steps=ns_steps, coeffs=ns_coeffs, eps=eps,
                         backend=ns_backend, gpu_iterate=ns_gpu_iterate)

  def prepare(g, m, layout):
    """One parameter: (its blocks [*batch, fan_in, fan_out] in ns_dtype, new momentum)."""
    if layout is None or not isinstance(layout, BlockLayout):
      raise ValueError(f"a parameter of shape {g.shape} reached Muon without a block layout")
    gv, mv = _unwrap(g).astype(jnp.float32), _unwrap(m)
    mv = beta * mv + gv
    u = gv + beta * mv if nesterov else mv
    return layout.to_blocks(u).astype(ns_dtype), mv

  def update(grads, state, params=None):
    del params
    flat, treedef = jax.tree.flatten(grads, is_leaf=is_variable)
    if not flat:
      return grads, state
    lays, moms = treedef.flatten_up_to(layouts), treedef.flatten_up_to(state.momentum)
    blocks, new_moms = zip(*(prepare(g, m, lay) for g, m, lay in zip(flat, moms, lays)))
    block_specs = (None if specs is None else
                   [lay.block_spec(s) for lay, s in zip(lays, treedef.flatten_up_to(specs))])
    orthogonal = orthogonalize_all(list(blocks), ns, mesh=mesh, specs=block_specs,
                                   group_bytes=group_bytes)
    updates = [(lay.from_blocks(o.astype(jnp.float32)) * (rms_scale * lay.scale)
                ).astype(_unwrap(g).dtype) for g, lay, o in zip(flat, lays, orthogonal)]
    return (jax.tree.unflatten(treedef, [_rewrap(g, u) for g, u in zip(flat, updates)]),
            MuonState(jax.tree.unflatten(treedef, [_rewrap(m, mv)
                                                   for m, mv in zip(moms, new_moms)])))

  return optax.GradientTransformation(init, update)


def _unwrap(x):
  return x.get_value() if is_variable(x) else x


def _rewrap(like, value):
  return like.replace(value) if is_variable(like) else value


def muon(cfg: ml_collections.ConfigDict, schedule: optax.Schedule, params: Any,
         decay_mask: Any, *, mesh: Mesh | None = None, param_specs: Any = None
         ) -> optax.GradientTransformation:
  """Per-head Muon for the matrices, AdamW for the rest, one schedule."""
  o, mu = cfg.optimizer, cfg.optimizer.muon
  labels = muon_labels(params, router=mu.router)
  layouts = block_layouts(params, per_head=mu.per_head)
  is_muon = jax.tree.map(lambda lab: lab == "muon", labels)
  rule = scale_by_muon(
      _only(layouts, is_muon), beta=mu.momentum, nesterov=mu.nesterov,
      ns_steps=mu.ns_steps, ns_coeffs=tuple(mu.ns_coeffs), rms_scale=mu.rms_scale,
      eps=mu.ns_eps, ns_dtype=jnp.dtype(mu.ns_dtype), ns_backend=mu.ns_backend,
      ns_gpu_iterate=mu.ns_gpu_iterate, group_bytes=mu.group_bytes, mesh=mesh,
      specs=None if param_specs is None else _only(param_specs, is_muon))
  muon_tx = optax.chain(rule, optax.add_decayed_weights(o.weight_decay, _only(decay_mask, is_muon)),
                        optax.scale_by_learning_rate(schedule))
  adamw_tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                         mask=_only(decay_mask, jax.tree.map(lambda m: not m, is_muon)))
  return optax.partition({"muon": muon_tx, "adamw": adamw_tx}, labels)


def _only(tree: Any, keep: Any) -> Any:
  """`tree` with MaskedNode where `keep` is False, as `optax.partition` masks."""
  return jax.tree.map(lambda x, k: x if k else optax.MaskedNode(), tree, keep,
                      is_leaf=lambda x: x is None or isinstance(x, (BlockLayout, PartitionSpec)))

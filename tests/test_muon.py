"""Per-head Muon (K3_SPEC 5): block layouts read from the model's metadata, one update
against optax.contrib.muon (whole-matrix and per-head), momentum over several steps
against a literal loop, and sharded blocks orthogonalized where they live."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

from conftest import micro_config, rel
from k3jax.config import ConfigError, base_config, validate
from k3jax.model import K3Model
from k3jax.model.layers import Dense, RMSNorm, param
from k3jax import parallel
from k3jax.optim import block_layouts, make_optimizer, muon_labels
from k3jax.optim.orthogonalize import block_groups
from pallas_kernels.newton_schulz import newton_schulz_reference

LR, WD, BETA, EPS = 0.02, 0.1, 0.95, 1e-7


class Toy(nnx.Module):
  """One parameter of each kind Muon has to tell apart."""

  def __init__(self, rngs=None):
    kw = dict(rngs=rngs or nnx.Rngs(0), dtype=jnp.float32)
    self.q = Dense(6, (3, 4), ("embed", "heads", "head_dim"), muon="per_head", **kw)
    self.o = Dense((3, 4), 6, ("heads", "head_dim", "embed"), **kw)
    self.w = Dense(6, 10, ("embed", "mlp"), **kw)
    self.experts = param(nnx.Rngs(1), jax.nn.initializers.normal(1.0), (4, 5, 6),
                         ("experts", "latent", "mlp"), muon="matrix",
                         muon_roles=("expert", "in", "out"))
    self.router = Dense(6, 4, ("embed", "experts"), muon="router", **kw)
    self.head = Dense(6, 7, ("embed", "vocab"), muon=None, **kw)
    self.norm = RMSNorm(6)


def _cfg(*, per_head=True, router="adamw"):
  c = base_config()
  o = c.optimizer
  o.name, o.learning_rate, o.warmup_steps, o.weight_decay, o.eps = "muon", LR, 0, WD, EPS
  o.muon.per_head, o.muon.router = per_head, router
  o.muon.ns_dtype, o.muon.ns_backend, o.muon.ns_eps = "float32", "reference", EPS
  c.train.grad_clip_norm = 0.0
  return c


def _random_like(tree, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), tree)


# Where optax puts each Toy parameter, as MuonDimensionNumbers (None: AdamW).
WHOLE = {"q": Dims(0, (1, 2)), "o": Dims((0, 1), 2), "w": Dims(0, 1), "experts": Dims(1, 2)}
PER_HEAD = dict(WHOLE, q=Dims(0, 2))   # the head axis (1) becomes a batch axis


@pytest.mark.parametrize("per_head", [False, True])
def test_one_update_equals_optax_muon(per_head):
  toy = Toy()
  state = nnx.state(toy, nnx.Param)
  params = nnx.as_pure(state)
  grads = _random_like(params, 1)
  tx, _ = make_optimizer(_cfg(per_head=per_head), state)
  ours, _ = jax.jit(tx.update)(grads, tx.init(params), params)

  flat = lambda t: {k: v["kernel"] if isinstance(v, dict) else v
                    for k, v in nnx.to_pure_dict(t).items() if k in WHOLE}
  dims = PER_HEAD if per_head else WHOLE
  ref = optax.contrib.muon(LR, beta=BETA, eps=EPS, weight_decay=WD, nesterov=True,
                           consistent_rms=0.2, muon_weight_dimension_numbers=dims)
  p, g = flat(params), flat(grads)
  theirs, _ = ref.update(g, ref.init(p), p)
  for name in WHOLE:
    assert rel(flat(ours)[name], theirs[name]) < 1e-5, name


def test_per_head_and_whole_matrix_differ_only_on_heads():
  toy = Toy()
  state = nnx.state(toy, nnx.Param)
  params = nnx.as_pure(state)
  grads = _random_like(params, 2)
  updates = {}
  for per_head in (False, True):
    tx, _ = make_optimizer(_cfg(per_head=per_head), state)
    updates[per_head] = nnx.to_pure_dict(jax.jit(tx.update)(grads, tx.init(params), params)[0])
  assert rel(updates[True]["q"]["kernel"], updates[False]["q"]["kernel"]) > 0.1
  for name in ("o", "w"):
    np.testing.assert_array_equal(updates[True][name]["kernel"], updates[False][name]["kernel"])
  # Per head, each head's block is orthogonal on its own: scale^-1 * block has
  # singular values in the NS5 band, and its RMS matches 0.2 (K3_SPEC 5).
  # -update / lr = 0.2 sqrt(max fan) NS(U) + wd W
  q = np.asarray(updates[True]["q"]["kernel"]) / -LR
  q = q - WD * np.asarray(nnx.to_pure_dict(params)["q"]["kernel"])
  for h in range(3):
    sv = np.linalg.svd(q[:, h, :] / (0.2 * math.sqrt(6)), compute_uv=False)
    assert 0.6 < sv.min() and sv.max() < 1.25, sv


def test_momentum_over_steps_matches_literal_loop():
  """M <- beta M + G; U = G + beta M; W <- W - lr (0.2 sqrt(max fan) NS(U) + wd W)."""
  toy = Toy()
  state = nnx.state(toy, nnx.Param)
  params = nnx.as_pure(state)
  tx, sched = make_optimizer(_cfg(), state)
  opt_state = tx.init(params)
  step = jax.jit(tx.update)
  w = np.asarray(nnx.to_pure_dict(params)["w"]["kernel"], np.float64)
  m = np.zeros_like(w)
  for t in range(3):
    grads = _random_like(params, 10 + t)
    updates, opt_state = step(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    g = np.asarray(nnx.to_pure_dict(grads)["w"]["kernel"], np.float64)
    m = BETA * m + g
    o = np.asarray(newton_schulz_reference(jnp.asarray(g + BETA * m, jnp.float32)), np.float64)
    w = w - float(sched(t)) * (0.2 * math.sqrt(10) * o + WD * w)
    np.testing.assert_allclose(np.asarray(nnx.to_pure_dict(params)["w"]["kernel"]), w,
                               rtol=2e-5, atol=1e-6)


def test_labels_and_layouts_of_the_scanned_model():
  """From metadata only: stacked layers and experts are batches of blocks, heads too under
  per-head Muon; embeddings, LM head, norms and (by default) the router go to AdamW."""
  model = nnx.eval_shape(lambda: K3Model(micro_config().model, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  labels = nnx.to_pure_dict(muon_labels(state))
  per_head = nnx.to_pure_dict(block_layouts(state, per_head=True))
  whole = nnx.to_pure_dict(block_layouts(state, per_head=False))

  q = per_head["cycles"]["layers"][0]["mixer"]["q_proj"]["kernel"]     # [2, 32, 2, 16]
  assert (q.batch, q.fan_in, q.fan_out) == ((2, 2), 32, 16)
  q = whole["cycles"]["layers"][0]["mixer"]["q_proj"]["kernel"]
  assert (q.batch, q.fan_in, q.fan_out) == ((2,), 32, 32)
  wkv_b = per_head["suffix"][0]["mixer"]["wkv_b"]["kernel"]            # [16, 2, 8 + 16]
  assert (wkv_b.batch, wkv_b.fan_in, wkv_b.fan_out) == ((2,), 16, 24)
  w_o = per_head["suffix"][0]["mixer"]["w_o"]["kernel"]                # [2, 16, 32]: whole
  assert (w_o.batch, w_o.fan_in, w_o.fan_out) == ((), 32, 32)
  w_d = per_head["cycles"]["layers"][0]["ffn"]["w_d"]                  # [2, 8, 32, 16]
  assert (w_d.batch, w_d.fan_in, w_d.fan_out) == ((2, 8), 32, 16)

  assert labels["embed"] == "adamw" and labels["lm_head"]["kernel"] == "adamw"
  assert labels["final_norm"]["weight"] == "adamw"
  moe = labels["cycles"]["layers"][0]["ffn"]
  assert moe["router"]["kernel"] == "adamw" and moe["w_g"] == "muon"
  kda = labels["cycles"]["layers"][0]["mixer"]
  assert kda["q_conv"] == "adamw" and kda["A_log"] == "adamw" and kda["f_up"]["kernel"] == "muon"
  assert nnx.to_pure_dict(muon_labels(state, router="muon"))["cycles"]["layers"][0]["ffn"][
      "router"]["kernel"] == "muon"


def test_blocks_are_the_heads():
  model = nnx.eval_shape(lambda: K3Model(micro_config().model, rngs=nnx.Rngs(0)))
  layout = nnx.to_pure_dict(block_layouts(nnx.state(model, nnx.Param), per_head=True))[
      "cycles"]["layers"][0]["mixer"]["q_proj"]["kernel"]
  x = jnp.asarray(np.random.default_rng(0).standard_normal(layout.shape), jnp.float32)
  blocks = layout.to_blocks(x)                                # [layers, heads, embed, head_dim]
  np.testing.assert_array_equal(blocks[1, 0], x[1, :, 0, :])
  np.testing.assert_array_equal(layout.from_blocks(blocks), x)


def _model_update(group_bytes, *, mesh=None):
  """(Muon's update of micro_config's model, the jaxpr's dot_general count) with
  optimizer.muon.group_bytes; mesh: the parameters' shardings from the model's rules."""
  model = nnx.eval_shape(lambda: K3Model(micro_config().model, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  params = _random_like(nnx.as_pure(state), 5)
  grads = _random_like(params, 6)
  cfg = _cfg()
  cfg.optimizer.muon.group_bytes = group_bytes
  specs = parallel.param_specs(state) if mesh is not None else None
  tx, _ = make_optimizer(cfg, state, mesh=mesh, param_specs=specs)
  update = lambda g, s, p: tx.update(g, s, p)[0]
  opt_state = tx.init(params)
  if mesh is not None:
    param_sh, opt_sh = parallel.state_shardings(mesh, tx, state)
    params, grads = (jax.device_put(t, param_sh) for t in (params, grads))
    opt_state = jax.device_put(opt_state, opt_sh)
  dots = str(jax.make_jaxpr(update)(grads, opt_state, params)).count("dot_general")
  return jax.jit(update)(grads, opt_state, params), dots


def test_same_shaped_blocks_of_all_parameters_are_orthogonalized_together():
  """Grouped by block shape (the default), the model's Muon update equals one
  Newton-Schulz a parameter, with several times fewer matmuls in the program."""
  grouped, grouped_dots = _model_update(256 * 2**20)
  alone, alone_dots = _model_update(0)
  for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(alone)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert 3 * grouped_dots < alone_dots


def test_grouped_blocks_sharded_equal_unsharded():
  """The model's parameters sharded over data 2 x fsdp 2 x expert 2 by its rules: the grouped
  update under shard_map (blocks regrouped by all-to-all) equals the unsharded one."""
  mesh = jax.make_mesh((2, 2, 2, 1, 1), ("data", "fsdp", "expert", "context", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 5)
  sharded, _ = _model_update(256 * 2**20, mesh=mesh)
  plain, _ = _model_update(0)
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
    assert rel(a, b) < 1e-5


def test_groups_keep_order_and_their_byte_cap():
  assert block_groups(["a", "b", "a", "a", "b"], [1, 1, 1, 1, 1], 2) == [
      [0, 2], [1, 4], [3]]
  assert block_groups(["a", "a", "a"], [3, 1, 1], 2) == [[0], [1, 2]]   # too big: alone
  assert block_groups(["a", "a"], [1, 1], 0) == [[0], [1]]


def _sharded_update(var, sharding, backend):
  """Muon's update of the one parameter `var` (an nnx.Param with Muon metadata) with its
  arrays placed as `sharding`: (the compiled update's HLO, the sharded update, the update
  computed unsharded)."""
  meta = nnx.State({"w": var})
  cfg = _cfg()
  cfg.optimizer.muon.ns_backend = backend
  tx, _ = make_optimizer(cfg, meta, mesh=sharding.mesh,
                         param_specs=nnx.State({"w": sharding.spec}))
  params = nnx.as_pure(meta)
  grads = jax.tree.map(lambda p: 0.5 * p + 1.0, params)
  put = lambda t: jax.tree.map(lambda a: jax.device_put(a, sharding), t)
  update = lambda g, s, p: tx.update(g, s, p)[0]
  state = jax.jit(tx.init)(params)
  state = jax.tree.map(lambda a: jax.device_put(a, sharding) if a.ndim == 3 else a, state)
  compiled = jax.jit(update).lower(put(grads), state, put(params)).compile()
  sharded = compiled(put(grads), state, put(params))["w"]
  plain_tx, _ = make_optimizer(_cfg(), meta)
  plain = jax.jit(lambda g, s, p: plain_tx.update(g, s, p)[0])(grads, plain_tx.init(params),
                                                                params)["w"]
  return compiled.as_text(), sharded, plain


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_sharded_heads_are_orthogonalized_in_place(backend):
  """Per-head blocks sharded over 8 devices along the head axis: the compiled update has
  no all-gather and equals the unsharded one, with XLA's Newton-Schulz (partitioned by
  XLA) and with the Pallas kernel (run per device under shard_map; interpret mode here)."""
  x = np.random.default_rng(3).standard_normal((16, 8, 12)).astype(np.float32)
  var = nnx.Param(jnp.asarray(x), out_sharding=("embed", "heads", "head_dim"),
                  eager_sharding=False, muon="matrix", muon_roles=("in", "head", "out"))
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
  by_head = NamedSharding(mesh, P(None, "tensor", None))
  hlo, sharded, plain = _sharded_update(var, by_head, backend)
  assert "all-gather" not in hlo
  assert sharded.sharding.spec == by_head.spec
  assert rel(sharded, plain) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fsdp_split_blocks_are_orthogonalized_once(backend):
  """An expert stack [experts, in, out] sharded over expert=2 and, inside each block, over
  fsdp=4 (fan-in): the compiled update regroups whole blocks by all-to-all, so that each
  device orthogonalizes 1/4 of its experts' blocks (the 2 local ones padded to 4) instead
  of gathering and orthogonalizing all of them; no all-gather; equal to the unsharded
  update."""
  x = np.random.default_rng(4).standard_normal((4, 16, 12)).astype(np.float32)
  var = nnx.Param(jnp.asarray(x), out_sharding=("experts", "embed", "mlp"),
                  eager_sharding=False, muon="matrix", muon_roles=("expert", "in", "out"))
  mesh = jax.make_mesh((4, 2), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  hlo, sharded, plain = _sharded_update(var, NamedSharding(mesh, P("expert", "fsdp", None)),
                                        backend)
  assert "all-gather" not in hlo and "all-to-all" in hlo
  assert rel(sharded, plain) < 1e-5


def test_muon_needs_the_parameter_metadata():
  with pytest.raises(ValueError, match="metadata"):
    make_optimizer(_cfg())


@pytest.mark.parametrize("field,value", [("router", "sgd"), ("ns_steps", 0),
                                         ("ns_dtype", "float16"), ("momentum", 1.0),
                                         ("ns_backend", "cuda"), ("group_bytes", -1)])
def test_bad_muon_settings_are_named(field, value):
  c = base_config()
  setattr(c.optimizer.muon, field, value)
  with pytest.raises(ConfigError, match=f"config.optimizer.muon.{field}"):
    validate(c)


@pytest.mark.parametrize("old,new", [("xla", "reference"), ("gram_xla", "gram_reference"),
                                     ("pallas", "kernel")])
def test_old_ns_backend_names_are_told_the_new_ones(old, new):
  c = base_config()
  c.optimizer.muon.ns_backend = old
  with pytest.raises(ConfigError, match=f"ns_backend: '{old}' was renamed '{new}'"):
    validate(c)

"""The balancers beside Quantile Balancing (k3jax/model/balancing.py): the aux-free bias's
sign step, the Switch auxiliary loss by hand, in a LatentMoE under every dispatch, and in
train steps (microbatches, falling loss); the config's checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config, random_model, set_field
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import config as k3config
from k3jax import axes, parallel, program
from k3jax.model import balancing
from k3jax.model import quantile_balancing as qb
from k3jax.model.latent_moe import LatentMoE
from k3jax.model.moe_dispatch import DISPATCHES
from k3jax.steps import split_microbatches

# One pytest-xdist worker for the module (--dist loadgroup): the cached runs compile once.
pytestmark = pytest.mark.xdist_group("test_balancing")

sign_step = jax.jit(balancing.sign_step)
switch_loss = jax.jit(balancing.switch_loss)


def skewed_scores(num_tokens, num_experts, seed=0, offset_std=2.0):
  """Sigmoid router scores with strong per-expert offsets (numpy): an unbalanced router."""
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((num_tokens, num_experts)) + offset_std * rng.standard_normal(
      num_experts)
  return (1 / (1 + np.exp(-logits))).astype(np.float32)


# --- aux-free: the sign step ---------------------------------------------------------------


def test_sign_step_moves_each_bias_by_exactly_speed():
  speed = 0.01
  bias = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32) * 0.1  # [layers, E]
  load = np.array([[5, 1, 3, 3, 0, 6],    # mean 3: over, under, at, at, under, over
                   [3, 3, 3, 3, 3, 3],    # balanced
                   [0, 0, 0, 0, 0, 0]],   # no tokens
                  np.int32)
  new = np.asarray(sign_step(bias, load, speed))
  want = bias.copy()
  want[0] += np.float32(speed) * np.array([-1, 1, 0, 0, 1, -1], np.float32)
  np.testing.assert_array_equal(new, want)   # fp32, bit for bit
  np.testing.assert_array_equal(np.asarray(sign_step(bias[0], load[0], speed)), want[0])


def _hand_aux(model, make_moe):
  """An aux of `model.hidden`'s structure with make_moe(layer's bias shape) on the MoE
  layers: what `update_balance` and `balance_loss` read, without running the model."""
  aux = {"prefix": [], "cycles": [], "suffix": []}
  for group, _, layer in model.all_layers():
    aux[group].append({"moe": make_moe(layer.ffn.bias.shape)} if layer.is_moe else {})
  return aux


def test_update_balance_steps_every_moe_layers_bias():
  """K3Model.update_balance with "aux_free": each MoE layer's bias (a stacked [cycles, E]
  one for the scanned layers) moves by speed * sign(mean load - load), against its own
  load summed over the step."""
  cfg = micro_config()
  cfg.model.moe.balancing, cfg.model.moe.bias_update_speed = "aux_free", 0.003
  model = random_model(cfg.model)
  rng = np.random.default_rng(1)
  aux = _hand_aux(model, lambda shape: {"counts": np.zeros(()), "dropped": np.zeros(()),
                                        "load": rng.integers(0, 40, shape).astype(np.int32)})
  moes = [(aux[g][i]["moe"]["load"], layer.ffn) for g, i, layer in model.all_layers()
          if layer.is_moe]
  assert [ffn.bias.shape for _, ffn in moes] == [(8,)] * 3 + [(2, 8)] * 4 + [(8,)]
  before = [np.asarray(ffn.bias[...]) for _, ffn in moes]
  stats = model.update_balance(aux)
  for (load, ffn), old in zip(moes, before):
    step = np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(np.asarray(ffn.bias[...]) - old, 0.003 * step, atol=1e-7)
  assert float(stats["moe_max_load"]) > 1.0


def test_aux_free_balances_a_skewed_router():
  """route -> load -> sign step on fixed skewed scores: max/mean load falls from ~4 to near
  1. It then cycles around the balance point, every bias moving +-speed a step: how far from
  balance the cycle stays grows with speed (0.01 on these scores: max/mean ~1.2)."""
  k, steps, speed = 4, 400, 0.003

  @jax.jit
  def run(scores):
    def step(bias, _):
      load = qb.load_stats(qb.route(scores, bias, k)[0], scores.shape[-1])
      return (balancing.sign_step(bias, load["load"], speed),
              (load["max_over_mean"], load["min_over_mean"]))
    return jax.lax.scan(step, jnp.zeros(scores.shape[-1]), None, length=steps)

  _, (mx, mn) = jax.device_get(run(skewed_scores(8192, 16)))
  print("\nmax/mean every 25 steps:", " ".join(f"{r:.3f}" for r in mx[::25]))
  assert mx[0] > 3.0
  assert mx[-50:].max() < 1.1 and mn[-50:].min() > 0.85, (mx[-50:], mn[-50:])


# --- aux_loss: the Switch loss -----------------------------------------------------------

# 3 tokens, 4 experts, top-2; each row of scores sums to 2, so p = scores / 2
SCORES = np.array([[0.9, 0.5, 0.2, 0.4],
                   [0.1, 0.8, 0.7, 0.4],
                   [0.6, 0.6, 0.3, 0.5]], np.float32)
IDX = np.array([[0, 1], [1, 2], [0, 1]], np.int32)


def test_switch_loss_by_hand():
  # f = pairs [2, 3, 1, 0] / 6; P = column means of p: [0.8, 0.95, 0.6, 0.65] / 3
  np.testing.assert_allclose(float(switch_loss(SCORES, IDX)),
                             4 * (2 * 0.8 + 3 * 0.95 + 1 * 0.6) / (6 * 3), rtol=1e-6)
  # padding excluded: token 1 masked, f = [2, 2, 0, 0] / 4, P = [0.75, 0.55, 0.25, 0.45] / 2
  valid = np.array([True, False, True])
  masked = float(switch_loss(SCORES, IDX, valid))
  np.testing.assert_allclose(masked, 4 * (2 * 0.75 + 2 * 0.55) / (4 * 2), rtol=1e-6)
  np.testing.assert_allclose(float(switch_loss(SCORES[valid], IDX[valid])), masked, rtol=1e-6)
  assert float(switch_loss(SCORES, IDX, np.zeros(3, bool))) == 0.0


def test_switch_loss_is_one_on_uniform_routing():
  """E sum_j f_j P_j = 1 when the loads are uniform (whatever the scores) or the normalised
  scores are (whatever the loads): a weight alpha adds alpha on balanced routing."""
  scores = skewed_scores(8, 4, seed=2)
  cyclic = np.arange(16, dtype=np.int32).reshape(8, 2) % 4   # every expert 4 pairs of 16
  np.testing.assert_allclose(float(switch_loss(scores, cyclic)), 1.0, rtol=1e-6)
  skewed = np.tile(np.array([[0, 1]], np.int32), (8, 1))     # all pairs on experts 0, 1
  np.testing.assert_allclose(float(switch_loss(np.full((8, 4), 0.3, np.float32), skewed)), 1.0,
                             rtol=1e-6)
  assert float(switch_loss(scores, skewed)) != pytest.approx(1.0, rel=1e-2)


def test_balance_loss_is_alpha_times_the_token_weighted_mean_over_layers():
  """K3Model.balance_loss from the layers' aux["aux_loss"] (tokens x switch_loss): alpha
  at 1 on every layer; two microbatches' shares add up to the token-weighted mean."""
  cfg = micro_config()
  cfg.model.moe.balancing, cfg.model.moe.aux_loss_weight = "aux_loss", 0.02
  model = random_model(cfg.model)

  def aux_of(tokens, value):
    return _hand_aux(model, lambda shape: {"aux_loss": jnp.full(shape[:-1], tokens * value)})

  np.testing.assert_allclose(float(model.balance_loss(aux_of(50, 1.0), 50)), 0.02, rtol=1e-6)
  shares = model.balance_loss(aux_of(30, 1.5), 80) + model.balance_loss(aux_of(50, 1.1), 80)
  np.testing.assert_allclose(float(shares), 0.02 * (30 * 1.5 + 50 * 1.1) / 80, rtol=1e-6)
  cfg.model.moe.balancing, cfg.model.moe.aux_loss_weight = "aux_free", 0.0
  assert random_model(cfg.model).balance_loss(aux_of(50, 1.0), 50) is None


# --- in a LatentMoE ----------------------------------------------------------------------

B, T = 8, 16   # rows split 8 ways on test_expert_parallel_on_a_mesh's mesh


def _moe_cfg(balancing_, dispatch="dropless", **mesh):
  c = micro_config()
  c.model.moe.balancing, c.model.moe.dispatch = balancing_, dispatch
  c.model.moe.capacity_factor = 4.0   # 16 = T slots per expert and row: nothing is dropped
  if balancing_ == "aux_loss":
    c.model.moe.aux_loss_weight = 0.01
  for axis in parallel.MESH_AXES:
    c.mesh[axis] = mesh.get(axis, 1)
  return k3config.validate(c)


def _moe_step(graphdef, params, rest, x, valid, cot):
  """(y, aux, gradients of sum(y * cot) + aux["aux_loss"], the router's of aux_loss alone)."""
  def loss(params):
    y, aux = nnx.merge(graphdef, params, rest)(x, valid)
    return jnp.sum(y * cot) + aux["aux_loss"], (y, aux)
  (_, (y, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)

  def aux_loss(params):
    return nnx.merge(graphdef, params, rest)(x, valid)[1]["aux_loss"]
  return y, aux, grads, jax.grad(aux_loss)(params)


@functools.cache
def _moe_problem():
  """Weights (the router's scaled up: sharper scores), inputs with padded tails: (config,
  the step's arguments (pure params, rest, x, valid, cot), the params and rest Variables)."""
  cfg = _moe_cfg("aux_loss")
  model = random_model(cfg.model, model_cls=LatentMoE)
  model.router.kernel[...] = model.router.kernel[...] * 4.0
  _, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((B, T, cfg.model.d_model)).astype(np.float32)
  valid = np.arange(T)[None, :] < np.array([T, T - 5, T, T - 9, T, T, T - 1, T])[:, None]
  cot = rng.standard_normal(x.shape).astype(np.float32)
  return cfg, (nnx.as_pure(params), nnx.as_pure(rest), x, valid, cot), (params, rest)


@functools.cache
def _moe_run(balancing_, dispatch):
  """The LatentMoE step of `_moe_problem` with that balancing and dispatch, no mesh."""
  cfg = _moe_cfg(balancing_, dispatch)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg.model, rngs=nnx.Rngs(0))))
  return jax.device_get(jax.jit(functools.partial(_moe_step, graphdef))(*_moe_problem()[1]))


def test_aux_loss_in_latent_moe():
  """aux["aux_loss"] is the valid tokens times switch_loss of the layer's own routing
  (recomputed from its router); its gradient reaches the router and nothing else."""
  cfg, (params, rest, x, valid, _), _ = _moe_problem()
  _, aux, _, grads = _moe_run("aux_loss", "dropless")
  scores = jax.nn.sigmoid(x.reshape(-1, x.shape[-1]) @ np.asarray(params["router"]["kernel"]))
  idx = qb.route(scores, jnp.zeros(8), cfg.model.moe.top_k)[0]
  want = valid.sum() * float(switch_loss(scores, idx, valid.reshape(-1)))
  np.testing.assert_allclose(float(aux["aux_loss"]), want, rtol=1e-5)
  for path, g in nnx.to_flat_state(grads):
    if path == ("router", "kernel"):
      assert np.abs(g).max() > 0
    else:
      assert np.abs(g).max() == 0, path


@pytest.mark.parametrize("balancing_", ["aux_free", "aux_loss"])
def test_gates_do_not_depend_on_the_bias(balancing_):
  """A common shift of the bias selects the same experts: the output is the same (the
  mixing weights come from the scores alone), and the bias gets no gradient. "aux_loss"
  ignores the bias altogether: a bias that would select expert 0 everywhere changes nothing."""
  _, (params, rest, x, valid, cot), _ = _moe_problem()
  cfg = _moe_cfg(balancing_)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg.model, rngs=nnx.Rngs(0))))

  @jax.jit
  def run(bias):
    def loss(bias):
      r = jax.tree.map(lambda _: bias, rest)   # rest holds the bias alone
      y, aux = nnx.merge(graphdef, params, r)(x, valid)
      return jnp.sum(y * cot), (y, aux["load"])
    return jax.value_and_grad(loss, has_aux=True)(bias)

  bias = np.asarray(rest["bias"])
  (_, (y, load)), g_bias = run(bias)
  (_, (y_shift, load_shift)), _ = run(bias + 0.37)
  np.testing.assert_array_equal(load_shift, load)
  np.testing.assert_allclose(y_shift, y, rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(g_bias)).max() == 0
  (_, (y_one, load_one)), _ = run(np.eye(8, dtype=np.float32)[0] * 5)
  if balancing_ == "aux_free":
    assert load_one[0] == valid.sum()   # the bias selects ...
  else:
    np.testing.assert_array_equal(load_one, load)   # ... or is not read
    np.testing.assert_array_equal(y_one, y)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_every_dispatch(dispatch):
  """Each dispatch the config allows (on CPU: "expert_parallel_dropless" is "dropless",
  "auto" "capacity", without a mesh) gives the same loads and auxiliary loss as "dropless",
  and the same gradients, the dispatch's own differences aside (capacity drops none here)."""
  y, aux, grads, _ = _moe_run("aux_loss", dispatch)
  y1, aux1, grads1, _ = _moe_run("aux_loss", "dropless")
  assert int(aux["dropped"]) == 0
  np.testing.assert_array_equal(aux["load"], aux1["load"])
  np.testing.assert_allclose(aux["aux_loss"], aux1["aux_loss"], rtol=1e-6)
  np.testing.assert_allclose(y, y1, rtol=1e-4, atol=1e-5)
  for (path, g), (_, g1) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads1)):
    np.testing.assert_allclose(g, g1, rtol=1e-4, atol=1e-5, err_msg=str(path))


def test_expert_parallel_on_a_mesh():
  """dispatch "expert_parallel" on 8 devices (experts over 4, rows over 2): the auxiliary
  loss and its router gradient are those of the unsharded run."""
  _, (params, rest, x, valid, cot), (param_vars, rest_vars) = _moe_problem()
  cfg = _moe_cfg("aux_loss", "expert_parallel", expert=4, data=2)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg.model, rngs=nnx.Rngs(0))))
  mesh = parallel.make_mesh(cfg.mesh)
  rows = NamedSharding(mesh, parallel.batch_spec())
  args = (jax.device_put(params, parallel.shardings(mesh, param_vars)),
          jax.device_put(rest, parallel.shardings(mesh, rest_vars)),
          *(jax.device_put(a, rows) for a in (x, valid, cot)))
  with axes.use_rules(mesh, parallel.RULES):
    _, aux, _, router = jax.device_get(jax.jit(functools.partial(_moe_step, graphdef))(*args))
  _, aux1, _, router1 = _moe_run("aux_loss", "capacity")
  np.testing.assert_array_equal(aux["load"], aux1["load"])
  np.testing.assert_allclose(aux["aux_loss"], aux1["aux_loss"], rtol=1e-5)
  np.testing.assert_allclose(router["router"]["kernel"], router1["router"]["kernel"],
                             rtol=1e-4, atol=1e-7)


# --- config ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes,field", [
    ({"model.moe.balancing": "switch"}, "model.moe.balancing"),
    ({"model.moe.balancing": "aux_loss"}, "model.moe.aux_loss_weight"),   # no weight
    ({"model.moe.aux_loss_weight": 0.01}, "model.moe.aux_loss_weight"),   # with "quantile"
    ({"model.moe.balancing": "aux_free", "model.moe.aux_loss_weight": 0.01},
     "model.moe.aux_loss_weight"),
    ({"model.moe.balancing": "aux_loss", "model.moe.aux_loss_weight": -0.01},
     "model.moe.aux_loss_weight"),
    ({"model.moe.balancing": "aux_free", "model.moe.bias_update_speed": 0.0},
     "model.moe.bias_update_speed"),
])
def test_config_refuses(changes, field):
  c = micro_config()
  for dotted, value in changes.items():
    set_field(c, dotted, value)
  with pytest.raises(k3config.ConfigError, match=f"config.{field}:"):
    k3config.validate(c)


def test_config_accepts_each_balancing_with_every_dispatch():
  for name in balancing.BALANCINGS:
    for dispatch in DISPATCHES:
      c = micro_config()
      c.model.moe.balancing, c.model.moe.dispatch = name, dispatch
      c.model.moe.aux_loss_weight = 0.01 if name == "aux_loss" else 0.0
      k3config.validate(c)


# --- train steps -------------------------------------------------------------------------

STEPS = 8


def _train_cfg(balancing_, microbatches=1):
  """3 layers: a dense-FFN MLA layer, then two scanned MLA + LatentMoE cycles (stacked
  biases [2, E]); AdamW (the cheaper compile), one device."""
  c = micro_config()
  c.model.num_layers, c.model.mla_every, c.model.dense_layers = 3, 1, 1
  c.model.moe.balancing, c.model.moe.bias_update_speed = balancing_, 0.01
  c.model.moe.aux_loss_weight = 0.01 if balancing_ == "aux_loss" else 0.0
  c.optimizer.name = "adamw"
  c.train.global_batch, c.train.microbatches = 4, microbatches
  c.mesh.data = 1
  return k3config.validate(c)


def _batch(cfg):
  """Row r ends with 5r padding tokens: microbatches {0, 2} and {1, 3} differ in size."""
  t = cfg.train
  tokens = np.random.default_rng(0).integers(1, cfg.model.vocab_size,
                                             (t.global_batch, t.seq_len + 1)).astype(np.int32)
  seg = (np.arange(t.seq_len)[None, :] < t.seq_len - 5 * np.arange(t.global_batch)[:, None])
  seg = seg.astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "positions": np.zeros_like(seg), "weights": seg.astype(np.float32)}


def _train(cfg):
  """STEPS train steps on one fixed batch from random_model's weights: (program, the initial
  (params, rest), the final rest, each step's out)."""
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  _, params, rest = nnx.split(random_model(cfg.model), nnx.Param, ...)
  params, rest = nnx.as_pure(params), nnx.as_pure(rest)
  rest = jax.tree.map(jnp.zeros_like, rest)   # the biases start at 0, as from init
  initial = jax.device_get((params, rest))    # the step donates its arguments
  state = (params, rest, prog.tx.init(params))
  batch = jax.device_put(_batch(cfg), prog.batch_shardings)
  outs = []
  with prog.rules():
    for _ in range(STEPS):
      *state, out = prog.train_step(*state, batch)
      outs.append(jax.device_get(out))
  return prog, initial, jax.device_get(state[1]), outs


def _assert_learns(outs):
  losses = [float(o["loss"]) for o in outs]
  assert np.all(np.isfinite(losses)) and not any(int(o["skipped"]) for o in outs)
  assert losses[-1] < losses[0] - 0.3, losses


def test_aux_free_trains():
  """Finite, falling loss; the biases (the state a checkpoint saves) move by +-speed or 0
  a step, so after STEPS steps each is a multiple of speed within STEPS of it."""
  *_, rest, outs = _train(_train_cfg("aux_free"))
  _assert_learns(outs)
  assert "moe_aux_loss" not in outs[0]
  biases = np.concatenate([np.ravel(b) for b in jax.tree.leaves(rest)]) / 0.01
  assert biases.size == 2 * 8 and np.abs(biases).max() > 0
  assert np.abs(biases).max() <= STEPS
  np.testing.assert_allclose(biases, np.round(biases), atol=1e-3)


def test_aux_loss_trains_with_microbatches():
  """Two microbatches of different token counts: step 1's moe_aux_loss is alpha times the
  token-weighted mean over the microbatches (and layers) of their forwards' switch_loss,
  the LM loss is logged apart from it; loss finite and falling; the biases stay 0."""
  cfg = _train_cfg("aux_loss", microbatches=2)
  prog, (params, rest), final_rest, outs = _train(cfg)
  _assert_learns(outs)
  batch = _batch(cfg)

  @jax.jit
  def forward(mb):
    model = nnx.merge(prog.graphdef, params, rest)
    h, aux = model.hidden(mb["inputs"], mb["segment_ids"])
    tokens = (mb["segment_ids"] > 0).sum()
    return tokens, aux["cycles"][0]["moe"]["aux_loss"] / tokens   # [2 cycles]

  mbs = split_microbatches(batch, 2)
  parts = [forward(jax.tree.map(lambda a, m=m: a[m], mbs)) for m in range(2)]
  tokens = np.array([float(n) for n, _ in parts])
  per_mb = np.array([np.mean(v) for _, v in parts])   # each microbatch's mean over layers
  assert tokens[0] != tokens[1]
  want = 0.01 * np.sum(tokens * per_mb) / tokens.sum()
  np.testing.assert_allclose(float(outs[0]["moe_aux_loss"]), want, rtol=1e-5)
  assert all(0.01 <= float(o["moe_aux_loss"]) < 0.02 for o in outs)
  jax.tree.map(lambda b: np.testing.assert_array_equal(b, 0), final_rest)

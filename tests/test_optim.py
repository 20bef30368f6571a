"""The optimizer factory: schedule, clipping, the weight-decay mask, AdamW against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.config import base_config
from k3jax.optim import OPTIMIZERS, make_optimizer, warmup_cosine, weight_decay_mask


def _cfg(*, lr=1e-2, warmup=0, steps=100, min_ratio=0.1, clip=0.0, wd=0.1):
  c = base_config()
  o = c.optimizer
  o.name = "adamw"   # this file specifies AdamW and the factory; Muon: test_muon.py
  o.learning_rate, o.warmup_steps, o.min_lr_ratio, o.weight_decay = lr, warmup, min_ratio, wd
  c.train.steps, c.train.grad_clip_norm = steps, clip
  return c


def test_schedule_values():
  s = warmup_cosine(1e-3, warmup_steps=10, total_steps=110, min_ratio=0.1)
  np.testing.assert_allclose(float(s(0)), 0.0)
  np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-6)
  np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)       # warmup end = peak
  np.testing.assert_allclose(float(s(60)), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-6)  # mid
  np.testing.assert_allclose(float(s(110)), 1e-4, rtol=1e-6)      # end = peak * min_ratio
  np.testing.assert_allclose(float(s(500)), 1e-4, rtol=1e-6)      # stays there
  np.testing.assert_allclose(float(jax.jit(s)(jnp.int32(60))), 5.5e-4, rtol=1e-6)
  no_warmup = warmup_cosine(1e-3, warmup_steps=0, total_steps=100, min_ratio=0.0)
  np.testing.assert_allclose(float(no_warmup(0)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(no_warmup(100)), 0.0, atol=1e-12)


def test_make_optimizer_schedule_follows_config():
  _, s = make_optimizer(_cfg(lr=2e-3, warmup=20, steps=220, min_ratio=0.5))
  np.testing.assert_allclose([float(s(i)) for i in (0, 10, 20, 120, 220)],
                             [0.0, 1e-3, 2e-3, 2e-3 * 0.75, 1e-3], rtol=1e-6)


def test_unknown_optimizer_names_known_ones():
  c = _cfg()
  c.optimizer.name = "sgdx"
  with pytest.raises(ValueError, match="sgdx.*known: adamw, muon"):
    make_optimizer(c)
  assert set(OPTIMIZERS) == {"adamw", "muon"}


def _reference_adamw(params, grads_seq, *, lr_fn, b1, b2, eps, wd, clip, decay):
  """Literal AdamW over numpy arrays: clip -> moments -> bias correction -> decoupled wd."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, g in enumerate(grads_seq, start=1):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    if clip > 0:
      norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
      g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
    lr = lr_fn(t - 1)
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      upd = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
      if decay[k]:
        upd = upd + wd * p[k]
      p[k] = p[k] - lr * upd
  return p


def _tiny_params():
  r = np.random.default_rng(0)
  return {"w": r.normal(size=(4, 3)).astype(np.float32),
          "b": r.normal(size=(3,)).astype(np.float32),
          "e": r.normal(size=(2, 3, 2)).astype(np.float32)}


def _grads(scale, seed):
  r = np.random.default_rng(seed)
  return {k: (scale * r.normal(size=x.shape)).astype(np.float32)
          for k, x in _tiny_params().items()}


def _run(tx, params, grads_seq):
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in grads_seq:
    updates, state = step(jax.tree.map(jnp.asarray, g), state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_matches_hand_written_adamw(clip):
  c = _cfg(lr=1e-2, warmup=2, steps=10, clip=clip)
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.95, 1e-8
  tx, sched = make_optimizer(c)
  grads_seq = [_grads(10.0, 1), _grads(0.05, 2), _grads(3.0, 3), _grads(0.1, 4)]
  got = _run(tx, _tiny_params(), grads_seq)
  want = _reference_adamw(_tiny_params(), grads_seq, lr_fn=lambda s: float(sched(s)),
                          b1=0.9, b2=0.95, eps=1e-8, wd=0.1, clip=clip,
                          decay={"w": True, "b": False, "e": True})
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_clipping_changes_the_update():
  grads_seq = [_grads(10.0, 1), _grads(0.05, 2)]   # first norm ~ 30 > 1, second < 1
  clipped = _run(make_optimizer(_cfg(clip=1.0))[0], _tiny_params(), grads_seq)
  unclipped = _run(make_optimizer(_cfg(clip=0.0))[0], _tiny_params(), grads_seq)
  # Feeding pre-clipped gradients to the unclipped optimizer gives the clipped result.
  norm = float(optax.tree.norm(jax.tree.map(jnp.asarray, grads_seq[0])))
  assert norm > 1.0 and float(optax.tree.norm(jax.tree.map(jnp.asarray, grads_seq[1]))) < 1.0
  pre = [jax.tree.map(lambda g: g / norm, grads_seq[0]), grads_seq[1]]
  manual = _run(make_optimizer(_cfg(clip=0.0))[0], _tiny_params(), pre)
  for k in clipped:
    np.testing.assert_allclose(np.asarray(clipped[k]), np.asarray(manual[k]), rtol=1e-5,
                               atol=1e-7)
  assert not np.allclose(np.asarray(clipped["w"]), np.asarray(unclipped["w"]))


def test_no_decay_on_vectors():
  # Zero gradients: the Adam part is 0, so the update is exactly -lr * wd * p where decayed.
  params = jax.tree.map(jnp.asarray, _tiny_params())
  tx, sched = make_optimizer(_cfg(lr=1e-2, wd=0.5))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  lr = float(sched(0))
  np.testing.assert_array_equal(np.asarray(updates["b"]), 0.0)
  for k in ("w", "e"):
    np.testing.assert_allclose(np.asarray(updates[k]), -lr * 0.5 * np.asarray(params[k]),
                               rtol=1e-6)


class _Stacked(nnx.Module):
  """A scanned-model stand-in: weights stacked over a leading "layers" axis."""

  def __init__(self):
    def p(shape, names, **meta):
      return nnx.Param(jnp.ones(shape), out_sharding=names, eager_sharding=False, **meta)
    self.embed = p((8, 4), ("vocab", "embed"))
    self.kernel = p((3, 4, 6), ("layers", "embed", "mlp"))
    self.norm = p((3, 4), ("layers", "embed"))
    self.queries = p((5, 4), ("sources", "embed"), weight_decay=False)
    self.a_log = p((3, 2), ("layers", "heads"))
    self.bias_state = nnx.BatchStat(jnp.zeros((3, 4)))   # not a Param: never optimized


def test_weight_decay_mask_reads_axis_names():
  mask = weight_decay_mask(nnx.state(_Stacked(), nnx.Param))
  assert dict(mask) == {"embed": True, "kernel": True, "norm": False, "queries": False,
                        "a_log": False}
  abstract = nnx.eval_shape(_Stacked)
  assert dict(weight_decay_mask(nnx.state(abstract, nnx.Param))) == dict(mask)


def test_nnx_optimizer_and_functional_paths_agree():
  model = _Stacked()
  mask = weight_decay_mask(nnx.state(model, nnx.Param))
  tx, sched = make_optimizer(_cfg(lr=1e-2, wd=0.5, clip=1.0), decay_mask=mask)

  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  opt.update(model, grads)

  lr = float(sched(0))
  np.testing.assert_allclose(np.asarray(model.kernel[...]), 1.0 - lr * 0.5, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(model.embed[...]), 1.0 - lr * 0.5, rtol=1e-6)
  for name in ("norm", "queries", "a_log"):
    np.testing.assert_array_equal(np.asarray(getattr(model, name)[...]), 1.0)
  np.testing.assert_array_equal(np.asarray(model.bias_state[...]), 0.0)

  params = nnx.as_pure(nnx.state(_Stacked(), nnx.Param))
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                                  params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(np.asarray(new["kernel"]), np.asarray(model.kernel[...]))
  np.testing.assert_array_equal(np.asarray(new["norm"]), 1.0)


def test_split_variable_state_path():
  """The trainer's functional path: tx over `nnx.split(model, nnx.Param, ...)` states."""
  model = _Stacked()
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx, sched = make_optimizer(_cfg(lr=1e-2, wd=0.5), decay_mask=weight_decay_mask(params))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  new = jax.tree.map(lambda p, u: p + u, params, updates)
  np.testing.assert_allclose(np.asarray(new["kernel"][...]), 1.0 - float(sched(0)) * 0.5,
                             rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(new["norm"][...]), 1.0)
  np.testing.assert_array_equal(np.asarray(new["queries"][...]), 1.0)


def test_schedule_numbers_are_state_not_program():
  """The schedule's numbers live in the optimizer state: a state given another config's
  numbers (`with_schedule`, as k3jax.train does after a restore) updates as that config's
  own optimizer does, from one traced update function."""
  from k3jax.optim import ScheduleParams, with_schedule  # noqa: PLC0415
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
  grads = {"w": jnp.full((4, 3), 0.5), "b": jnp.full((3,), -1.0)}
  short, long = _cfg(lr=1e-2, warmup=2, steps=10), _cfg(lr=3e-3, warmup=5, steps=50,
                                                       min_ratio=0.3)
  tx_short, _ = make_optimizer(short)
  tx_long, _ = make_optimizer(long)
  traces = []

  @jax.jit
  def update(state):
    traces.append(1)
    return tx_short.update(grads, state, params)

  state = tx_short.init(params)
  for _ in range(3):
    state = update(state)[1]
  moved = with_schedule(state, ScheduleParams.of(long))
  got, _ = update(moved)
  want, _ = tx_long.update(grads, moved, params)   # the same state under long's own tx
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert len(traces) == 1
  own, _ = update(state)
  assert not np.allclose(got["w"], own["w"])   # the numbers did change the update

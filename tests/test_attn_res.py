"""Block Attention Residuals: the direct read and the block bookkeeping (eager, unrolled and
scanned with traced indices) against numpy; the unrolled stack's separate slots against the
buffer; the scan that saves only the partial slot against jax.lax.scan."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from k3jax.model import attn_res
from k3jax.model.attn_res import (AttnResQuery, BlockState, attend, init_state, num_slots_for,
                                  read, valid_sources, write)

D, B, T, EPS = 16, 2, 3, 1e-5


def randn(seed, *shape, scale=1.0) -> np.ndarray:
  """numpy inputs: jax.random compiles slowly on CPU for every new shape."""
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def ref_attend(sources, w, g, eps=EPS) -> np.ndarray:
  """Spec 3 literally, float64: h = sum_i softmax_i(w . (RMSNorm(v_i) g)) v_i.
  sources: a list of [B, T, d] arrays (only the valid ones)."""
  v = np.stack([np.asarray(s, np.float64) for s in sources])          # [S, B, T, d]
  keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)
  logits = np.sum(keys * np.asarray(w, np.float64), axis=-1)          # [S, B, T]
  alpha = np.exp(logits - logits.max(axis=0))
  alpha /= alpha.sum(axis=0)
  return np.sum(alpha[..., None] * v, axis=0)


def query_module(w, g) -> AttnResQuery:
  q = AttnResQuery(D)
  q.query[...] = jnp.asarray(w)
  q.key_gain[...] = jnp.asarray(g)
  return q


def test_attend_matches_formula():
  sources = randn(0, 5, B, T, D, scale=2.0)
  valid = np.array([True, False, True, True, False])
  w, g = randn(1, D), 1 + randn(2, D, scale=0.3)
  h = jax.jit(attend, static_argnums=4)(jnp.asarray(sources), jnp.asarray(valid),
                                        jnp.asarray(w), jnp.asarray(g), EPS)
  assert h.shape == (B, T, D) and h.dtype == jnp.float32
  np.testing.assert_allclose(h, ref_attend(sources[valid], w, g), rtol=1e-5, atol=1e-6)
  h_all = attend(jnp.asarray(sources), None, jnp.asarray(w), jnp.asarray(g), EPS)
  np.testing.assert_allclose(h_all, ref_attend(sources, w, g), rtol=1e-5, atol=1e-6)


def test_zero_query_is_uniform_average_and_keeps_dtype():
  sources = randn(3, 4, B, T, D, scale=3.0)
  valid = jnp.asarray([True, True, False, True])
  q = AttnResQuery(D)  # initial state: query 0, gain 1
  assert not np.any(q.query[...]) and np.all(q.key_gain[...] == 1)
  assert q.query.out_sharding == ("embed",)
  h = q(jnp.asarray(sources), valid)
  np.testing.assert_allclose(h, sources[[0, 1, 3]].mean(axis=0), rtol=1e-6, atol=1e-6)
  h16 = q(jnp.asarray(sources, jnp.bfloat16), valid)
  assert h16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(h16, np.float32), np.asarray(h), rtol=2e-2, atol=5e-2)


def test_num_slots_for():
  assert num_slots_for(93, 12) == 9     # embedding + 7 completed blocks + the partial 8th
  assert num_slots_for(5, 2) == 4
  assert num_slots_for(24, 12) == 4     # the last block completes: an empty partial slot


# ---------------------------------------------------------------------------------------
# A stack of sublayers: out_l = tanh(h_l W_l), blocks of `block_layers` layers.


def stack_params(num_sub, seed=10):
  qs = randn(seed, num_sub, D, scale=0.7)
  gs = 1 + randn(seed + 1, num_sub, D, scale=0.3)
  ws = randn(seed + 2, num_sub, D, D, scale=D ** -0.5)
  q_out, g_out = randn(seed + 3, D, scale=0.7), 1 + randn(seed + 4, D, scale=0.3)
  return qs, gs, ws, q_out, g_out


def reference_stack(emb, qs, gs, ws, q_out, g_out, block_sub):
  """Explicit Python list of block sums; each sublayer's input by the direct formula."""
  blocks, partial, inputs = [np.asarray(emb, np.float64)], None, []
  for sub in range(len(qs)):
    h = ref_attend(blocks + ([] if partial is None else [partial]), qs[sub], gs[sub])
    inputs.append(h)
    out = np.tanh(h @ ws[sub])
    partial = out if partial is None else partial + out
    if (sub + 1) % block_sub == 0:
      blocks.append(partial)
      partial = None
  final = ref_attend(blocks + ([] if partial is None else [partial]), q_out, g_out)
  return np.stack(inputs), final, blocks, partial


def unrolled_stack(emb, ws, queries, out_query, block_sub, state):
  """The stack layer by layer in Python from `state` (a BlockState or Slots of emb)."""
  hs = []
  for query, w in zip(queries, ws):
    h = read(state, query)
    hs.append(h)
    state = write(state, jnp.tanh(h @ w), block_sub)
  return jnp.stack(hs), read(state, out_query), state


@pytest.mark.parametrize("num_layers", [5, 4])
def test_block_state_sequence_unrolled(num_layers):
  block_layers, block_sub = 2, 4
  num_sub = 2 * num_layers
  emb = randn(20, B, T, D)
  qs, gs, ws, q_out, g_out = stack_params(num_sub)
  queries = [query_module(qs[sub], gs[sub]) for sub in range(num_sub)]
  out_query = query_module(q_out, g_out)
  num_slots = num_slots_for(num_layers, block_layers)
  run = jax.jit(lambda emb: unrolled_stack(emb, ws, queries, out_query, block_sub,
                                           init_state(emb, num_slots)))

  hs, final, state = run(jnp.asarray(emb))
  ref_hs, ref_final, blocks, partial = reference_stack(emb, qs, gs, ws, q_out, g_out, block_sub)
  np.testing.assert_allclose(hs, ref_hs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(final, ref_final, rtol=1e-5, atol=1e-5)
  assert int(state.num_done) == len(blocks) - 1
  assert int(state.in_block) == (num_sub % block_sub)
  np.testing.assert_allclose(state.sources[:len(blocks)], np.stack(blocks), rtol=1e-5, atol=1e-5)
  if partial is not None:
    np.testing.assert_allclose(state.sources[len(blocks)], partial, rtol=1e-5, atol=1e-5)
  assert list(np.asarray(valid_sources(state))) == (
      [True] * len(blocks) + [partial is not None] + [False] * (num_slots - len(blocks) - 1))


@pytest.mark.parametrize("num_layers", [5, 4])
def test_slots_equal_the_buffer(num_layers):
  """`Slots` (each source its own array, counts static) hold the buffer's valid slots, and
  the stack through them gives the buffer's reads, outputs and gradients: the same stack
  with only the sources that exist."""
  block_layers, block_sub = 2, 4
  qs, gs, ws, q_out, g_out = stack_params(2 * num_layers, seed=50)
  emb = jnp.asarray(randn(51, B, T, D))

  def run(form, emb, ws):
    queries = [query_module(q, g) for q, g in zip(qs, gs)]
    start = (attn_res.init_slots(emb) if form == "slots"
             else init_state(emb, num_slots_for(num_layers, block_layers)))
    return unrolled_stack(emb, ws, queries, query_module(q_out, g_out), block_sub, start)

  def loss(form, emb, ws):
    hs, final, _ = run(form, emb, ws)
    return jnp.sum(jnp.sin(hs)) + jnp.sum(final ** 2)

  (hs, final, slots), (b_hs, b_final, buffer) = (
      jax.jit(functools.partial(run, form))(emb, jnp.asarray(ws)) for form in ("slots", "buffer"))
  np.testing.assert_allclose(hs, b_hs, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(final, b_final, rtol=1e-6, atol=1e-6)
  assert len(slots.blocks) == int(buffer.num_done) + 1 and slots.in_block == int(buffer.in_block)
  assert (slots.partial is None) == (slots.in_block == 0)
  np.testing.assert_allclose(jnp.stack(slots.sources), buffer.sources[:len(slots.sources)],
                             rtol=1e-6, atol=1e-6)
  grads = [jax.jit(jax.grad(functools.partial(loss, form), argnums=(0, 1)))(emb, jnp.asarray(ws))
           for form in ("slots", "buffer")]
  for got, want in zip(*grads):   # fp32 rounding of sums over fewer terms, relative to each
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def scanned_stack(emb, qs, gs, ws, q_out, g_out, num_slots, block_sub):
  """The same stack under jax.lax.scan: num_done / in_block are traced in the body."""
  graphdef, q_state = nnx.split(AttnResQuery(D))
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (len(qs), *p.shape)), q_state)
  stacked["query"][...] = qs
  stacked["key_gain"][...] = gs

  def body(state: BlockState, xs):
    q_st, w = xs
    h = read(state, nnx.merge(graphdef, q_st))
    return write(state, jnp.tanh(h @ w), block_sub), h

  state, hs = jax.lax.scan(body, init_state(emb, num_slots), (stacked, ws))
  final = attend(state.sources, valid_sources(state), q_out, g_out, EPS)
  return hs, final, state


def test_block_state_sequence_scanned():
  num_layers, block_layers, block_sub = 5, 2, 4
  num_sub = 2 * num_layers
  emb = randn(21, B, T, D)
  params = stack_params(num_sub, seed=30)
  run = jax.jit(scanned_stack, static_argnums=(6, 7))
  hs, final, state = run(jnp.asarray(emb), *map(jnp.asarray, params),
                         num_slots_for(num_layers, block_layers), block_sub)
  ref_hs, ref_final, blocks, partial = reference_stack(emb, *params, block_sub)
  np.testing.assert_allclose(hs, ref_hs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(final, ref_final, rtol=1e-5, atol=1e-5)
  assert (int(state.num_done), int(state.in_block)) == (2, 2)
  np.testing.assert_allclose(state.sources[3], partial, rtol=1e-5, atol=1e-5)

  # gradients reach every sublayer's query and gain, and the output query and gain
  def loss(emb, qs, gs, ws, q_out, g_out):
    hs, final, _ = scanned_stack(emb, qs, gs, ws, q_out, g_out, 4, block_sub)
    return jnp.sum(final ** 2) + jnp.sum(jnp.sin(hs))

  grads = jax.jit(jax.grad(loss, argnums=(1, 2, 4, 5)))(jnp.asarray(emb), *map(jnp.asarray, params))
  for g in grads:
    g = np.asarray(g).reshape(-1, D)
    assert np.isfinite(g).all()
  # sublayer 0 reads only the embedding: its weights are 1 whatever w and g are
  assert np.abs(grads[0][0]).max() == 0 and np.abs(grads[1][0]).max() == 0
  assert (np.abs(np.asarray(grads[0][1:])).max(axis=-1) > 0).all()
  assert (np.abs(np.asarray(grads[1][1:])).max(axis=-1) > 0).all()
  assert np.abs(grads[2]).max() > 0 and np.abs(grads[3]).max() > 0


def _two_sublayer_step(graphdef, block_sub):
  """A scan step of two sublayers (read, write; read, write), like a scanned cycle; y holds
  the first read (float) and the counter after the step (int)."""
  def step(state: BlockState, xs):
    q_st, w = xs
    query = nnx.merge(graphdef, q_st)
    h = read(state, query)
    state = write(state, jnp.tanh(h @ w[0]), block_sub)
    state = write(state, jnp.sin(read(state, query) @ w[1]), block_sub)
    return state, {"h": h, "done": state.num_done}
  return step


@pytest.mark.parametrize("remat", [False, True])
def test_partial_slot_scan_equals_lax_scan(remat):
  """attn_res.scan: 5 steps of 2 writes, blocks of 3 (they complete inside steps and across
  them): the final state and ys, and the gradients of a loss of both with respect to the
  embedding, every query, gain and weight, equal jax.lax.scan's; with the step under remat
  too. Its compiled gradient never holds the per-step stack of whole buffers
  [5, S, B, T, d] that jax.lax.scan saves."""
  steps, block_sub, num_slots = 5, 3, 6
  graphdef, q_state = nnx.split(AttnResQuery(D))
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (steps, *p.shape)), q_state)
  stacked["query"][...] = randn(40, steps, D)
  stacked["key_gain"][...] = 1 + randn(41, steps, D, scale=0.1)
  ws = randn(42, steps, 2, D, D, scale=D ** -0.5)
  emb = randn(43, B, T, D)
  step = _two_sublayer_step(graphdef, block_sub)
  if remat:
    step = jax.checkpoint(step)

  def loss(scan, emb, xs):
    state, ys = scan(step, init_state(emb, num_slots), xs)
    return (jnp.sum(state.sources ** 2) + jnp.sum(jnp.cos(ys["h"]))
            + jnp.sum(ys["done"].astype(jnp.float32))), (state, ys)

  def run(scan):
    grad = jax.jit(jax.grad(lambda e, x: loss(scan, e, x), argnums=(0, 1), has_aux=True))
    return grad(jnp.asarray(emb), (stacked, jnp.asarray(ws)))

  (grads, (state, ys)), (ref_grads, (ref_state, ref_ys)) = run(attn_res.scan), run(jax.lax.scan)
  assert (int(state.num_done), int(state.in_block)) == (3, 1)  # 10 writes, blocks of 3
  for got, want in zip(jax.tree.leaves((state, ys)), jax.tree.leaves((ref_state, ref_ys))):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def hlo(scan):
    return jax.jit(jax.grad(lambda e, x: loss(scan, e, x)[0])).lower(
        jnp.asarray(emb), (stacked, jnp.asarray(ws))).compile().as_text()
  stack = f"f32[{steps},{num_slots},{B},{T},{D}]"
  assert stack in hlo(jax.lax.scan) and stack not in hlo(attn_res.scan)


def test_gradients_match_finite_differences():
  sources = jnp.asarray(randn(40, 3, B, T, D))
  w, g = jnp.asarray(randn(41, D, scale=0.5)), jnp.asarray(1 + randn(42, D, scale=0.3))

  def f(w, g):
    return jnp.sum(jnp.sin(attend(sources, None, w, g, EPS)))

  check_grads(f, (w, g), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)
  gw, gg = jax.grad(f, argnums=(0, 1))(jnp.zeros(D), jnp.ones(D))  # at init
  assert np.abs(gw).max() > 0 and np.abs(gg).max() == 0  # gain has no effect while w = 0

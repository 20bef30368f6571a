"""Gated MLA against a per-head loop reference, and its masks, shared key and gate."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from k3jax.config import base_config
from k3jax.model.mla import MLA, attention, attention_mask

H, NOPE, ROPE, V = 3, 8, 4, 6


def small_model_cfg(dtype: str = "float32") -> ml_collections.ConfigDict:
  """base_config().model shrunk to a few-hundred-parameter MLA."""
  m = base_config().model
  m.d_model, m.norm_eps, m.dtype, m.param_dtype = 32, 1e-6, dtype, "float32"
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = H, 16, 12
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = NOPE, ROPE, V
  return m


@functools.cache
def _make(dtype: str) -> MLA:
  abstract = nnx.eval_shape(lambda: MLA(small_model_cfg(dtype), rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(0)

  def fill(leaf):
    if len(leaf.shape) == 1:  # norm gains: near 1, so a wrong gain would show
      return jnp.asarray(1 + 0.2 * rng.standard_normal(leaf.shape, np.float32))
    return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) / math.sqrt(leaf.shape[0]))

  return nnx.merge(graphdef, jax.tree.map(fill, state))


def make(dtype="float32") -> MLA:
  """A fresh copy of one small MLA with numpy-random parameters (the same values for
  every dtype; jax.random init compiles slowly on CPU)."""
  return nnx.clone(_make(dtype))


@nnx.jit
def fwd(m: MLA, x, seg):
  return m(x, seg)[0]


@nnx.jit
def fwd_heads(m: MLA, x, seg):
  return m.heads(x, seg)[0]


def w(mod) -> np.ndarray:
  return np.asarray(mod.kernel[...], np.float64)


def reference(mla: MLA, x: np.ndarray, seg: np.ndarray) -> np.ndarray:
  """Literal float64 MLA: explicit loops over batch, head, query and allowed keys."""
  x = np.asarray(x, np.float64)

  def rms(v, gain):
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * gain

  kv_lora = mla.kv_lora
  c_q = rms(x @ w(mla.wq_a), np.asarray(mla.q_norm.weight[...], np.float64))
  kv_a = x @ w(mla.wkv_a)
  c_kv = rms(kv_a[..., :kv_lora], np.asarray(mla.kv_norm.weight[...], np.float64))
  k_r = kv_a[..., kv_lora:]
  wq_b, wkv_b, w_g, w_o = w(mla.wq_b), w(mla.wkv_b), w(mla.w_g), w(mla.w_o)
  b_sz, t_sz, _ = x.shape
  y = np.zeros_like(x)
  for b in range(b_sz):
    for h in range(H):
      q = c_q[b] @ wq_b[:, h]                      # [T, nope + rope]
      kv = c_kv[b] @ wkv_b[:, h]                   # [T, nope + v]
      k = np.concatenate([kv[:, :NOPE], k_r[b]], axis=-1)
      v = kv[:, NOPE:]
      gate = 1 / (1 + np.exp(-(x[b] @ w_g[:, h])))  # [T, V]
      for t in range(t_sz):
        keys = [s for s in range(t + 1)
                if seg[b, s] == seg[b, t] and (seg[b, t] != 0 or s == t)]
        scores = np.array([q[t] @ k[s] for s in keys]) / math.sqrt(NOPE + ROPE)
        p = np.exp(scores - scores.max())
        p /= p.sum()
        o = sum(pi * v[s] for pi, s in zip(p, keys))
        y[b, t] += (o * gate[t]) @ w_o[h]
  return y


SEG = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0],
                [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                [3, 3, 0, 0, 5, 5, 5, 0, 0, 0]], np.int32)


def randn(seed, *shape) -> jax.Array:
  """Test inputs from numpy: jax.random compiles slowly on CPU for every new shape."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def inputs(b=3, t=10, seed=1):
  return randn(seed, b, t, 32)


def test_init_shapes():
  mla = nnx.eval_shape(lambda: MLA(small_model_cfg(), rngs=nnx.Rngs(0)))
  assert mla.wq_b.kernel.shape == (16, H, NOPE + ROPE)
  assert mla.wkv_a.kernel.shape == (32, 12 + ROPE)
  assert mla.wkv_b.kernel.shape == (12, H, NOPE + V)
  assert mla.w_g.kernel.shape == (32, H, V) and mla.w_o.kernel.shape == (H, V, 32)
  assert mla.wq_b.kernel.out_sharding == ("q_lora", "heads", "head_dim")


def test_matches_per_head_loop_reference():
  mla = make()
  x = inputs()
  y = fwd(mla, x, jnp.asarray(SEG))
  assert y.shape == x.shape and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), reference(mla, np.asarray(x), SEG),
                             rtol=2e-5, atol=2e-6)


def test_shared_rope_key_is_one_vector():
  mla = make()
  x = inputs()
  seg = jnp.asarray(SEG)
  _, k, _ = nnx.jit(lambda m, x: m.project(x))(mla, x)
  k_rope = np.asarray(k[..., NOPE:])                                   # [B, T, H, rope]
  np.testing.assert_array_equal(k_rope, np.broadcast_to(k_rope[:, :, :1], k_rope.shape))
  base = np.asarray(fwd_heads(mla, x, seg))

  # one head's rope-slot query changes that head only
  other = nnx.clone(mla)
  kq = other.wq_b.kernel[...]
  other.wq_b.kernel[...] = kq.at[:, 1, NOPE:].multiply(3.0)
  diff = np.abs(np.asarray(fwd_heads(other, x, seg)) - base).max(axis=(0, 1, 3))
  assert diff[1] > 1e-3 and diff[0] == 0 and diff[2] == 0

  # the shared key slot changes every head
  other = nnx.clone(mla)
  ka = other.wkv_a.kernel[...]
  other.wkv_a.kernel[...] = ka.at[:, mla.kv_lora:].multiply(3.0)
  diff = np.abs(np.asarray(fwd_heads(other, x, seg)) - base).max(axis=(0, 1, 3))
  assert (diff > 1e-3).all()


def test_document_mask_packed_equals_alone():
  mla = make()
  x = inputs(seed=2)                    # [3, 10, d]; all calls share one shape
  # row 0: doc A (4 tokens) then doc B (4) then padding; row 1: doc B alone at the start
  # with its own id, then junk padding; row 2: doc A followed by a different document
  x = x.at[1, :4].set(x[0, 4:8]).at[2, :4].set(x[0, :4])
  seg = jnp.asarray([[1] * 4 + [2] * 4 + [0] * 2,
                     [7] * 4 + [0] * 6,
                     [1] * 4 + [2] * 6], jnp.int32)
  y = fwd(mla, x, seg)
  np.testing.assert_allclose(y[0, 4:8], y[1, :4], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y[0, :4], y[2, :4], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(y[0, 4:8] - fwd(mla, x, jnp.ones_like(seg))[0, 4:8])).max() > 1e-3


def test_causal():
  mla = make()
  x = inputs(seed=4)
  seg = jnp.ones((3, 10), jnp.int32)
  y = fwd(mla, x, seg)
  for t in (0, 4, 8):
    x2 = x.at[:, t + 1:].set(randn(t, 3, 9 - t, 32))
    y2 = fwd(mla, x2, seg)
    np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(y2[:, t + 1:] - y[:, t + 1:])).max() > 1e-3


def test_no_nan_with_padding_forward_and_grad():
  mla = make()
  x = inputs(seed=5)
  seg = jnp.asarray(SEG).at[1].set(0)   # rows with trailing/inner padding and one all padding

  def loss(m, x):
    return jnp.sum(m(x, seg)[0] ** 2)

  y = fwd(mla, x, seg)
  assert np.isfinite(np.asarray(y)).all()
  grads = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mla, x)
  leaves = jax.tree.leaves(nnx.state(grads[0])) + [grads[1]]
  assert len(leaves) > 2 and all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert bool(jnp.all(jnp.any(attention_mask(seg), axis=-1)))


@nnx.jit
def ungated(m: MLA, x, seg):
  q, k, v = m.project(x)
  return m.w_o(attention(q, k, v, seg, m.scale)[0])


def test_output_gate_zero_is_half():
  mla = make()
  x = inputs()
  seg = jnp.asarray(SEG)
  y_ungated = ungated(mla, x, seg)
  mla.w_g.kernel[...] = jnp.zeros_like(mla.w_g.kernel[...])
  np.testing.assert_allclose(fwd(mla, x, seg), 0.5 * y_ungated, rtol=1e-6, atol=1e-7)


def test_attention_shared_key_broadcast():
  q, k1, v = randn(6, 2, 7, 4, 5), randn(7, 2, 7, 1, 5), randn(8, 2, 7, 4, 3)
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [4] * 7], jnp.int32)
  att = jax.jit(lambda *a: attention(*a)[0], static_argnums=4)
  out1 = att(q, k1, v, seg, 0.4)
  out4 = att(q, jnp.broadcast_to(k1, (2, 7, 4, 5)), v, seg, 0.4)
  np.testing.assert_allclose(out1, out4, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_compute_close_to_fp32(dtype):
  x = inputs()
  seg = jnp.asarray(SEG)
  y32 = fwd(make("float32"), x, seg)
  y16 = fwd(make(dtype), x, seg)
  assert y16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(y16, np.float32) - np.asarray(y32))
  assert err.max() < 0.05 * np.abs(np.asarray(y32)).max()


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_absorbed_form_equals_expanded(backend):
  """model.mla.form = "absorbed" (W_kvb folded into the queries and outputs; attention over
  c_kv and the shared key, one "head" for all; "kernel": splash's multi-query kernel,
  interpreted) computes the expanded form's outputs, max logits and gradients."""
  expanded = make()
  cfg = small_model_cfg()
  cfg.mla.form, cfg.mla.attention = "absorbed", backend
  absorbed = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: MLA(cfg, rngs=nnx.Rngs(0)))),
                       nnx.state(expanded))
  x, seg, w_out = inputs(seed=6), jnp.asarray(SEG), randn(7, 3, 10, 32)

  @nnx.jit
  def run(m):
    def loss(m):
      y, aux = m(x, seg)
      return jnp.sum(y * w_out), (y, aux["logit_max"])
    return nnx.grad(loss, has_aux=True)(m)

  (grads, (y, logit)), (grads1, (y1, logit1)) = run(absorbed), run(expanded)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(logit), np.asarray(logit1), rtol=1e-6)
  # per parameter, relative to its gradient's norm: the two forms round differently (fp32)
  for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads1)):
    g, g1 = np.asarray(g), np.asarray(g1)
    assert np.linalg.norm(g - g1) <= 1e-6 * np.linalg.norm(g1), jax.tree_util.keystr(path)

"""QK-Clip (K3_SPEC 5): the tracked max logit is the true one, the clip equals a
hand-written per-head rescale, and after it no head's logit exceeds tau (also for the
stacked MLA layers of the scanned cycles)."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import micro_config, random_model
from test_mla import NOPE, ROPE, SEG, H, inputs, make

TAU_FRACTION = 0.5   # tau halfway between the smallest and largest head maxima


@nnx.jit
def fwd_aux(m, x, seg):
  return m(x, seg)[1]["logit_max"]


def _true_logit_max(mla, x, seg) -> np.ndarray:
  """Per head: the largest scaled q.k over real queries and the keys they may see."""
  q, k, _ = nnx.jit(lambda m, x: m.project(x))(mla, x)
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  out = np.full(H, -np.inf)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      if seg[b, t] == 0:
        continue
      for s in range(t + 1):
        if seg[b, s] == seg[b, t]:
          out = np.maximum(out, np.einsum("hd,hd->h", q[b, t], k[b, s]) / math.sqrt(NOPE + ROPE))
  return out


def test_tracked_logit_max_is_the_true_max():
  mla = make()
  x = inputs() * 3.0
  np.testing.assert_allclose(fwd_aux(mla, x, jnp.asarray(SEG)), _true_logit_max(mla, x, SEG),
                             rtol=1e-5)


def test_clip_equals_hand_rescale_and_caps_the_logits():
  mla = make()
  x = inputs() * 3.0
  seg = jnp.asarray(SEG)
  s_max = np.asarray(fwd_aux(mla, x, seg), np.float64)
  tau = float(s_max.min() + TAU_FRACTION * (s_max.max() - s_max.min()))
  over = s_max > tau
  assert over.any() and not over.all()

  wq, wkv = np.asarray(mla.wq_b.kernel[...]), np.asarray(mla.wkv_b.kernel[...])
  wkv_a = np.asarray(mla.wkv_a.kernel[...])
  expect_q, expect_kv = wq.astype(np.float64), wkv.astype(np.float64)
  for h in np.flatnonzero(over):
    gamma = tau / s_max[h]
    expect_q[:, h, :NOPE] *= math.sqrt(gamma)      # W_q^C
    expect_q[:, h, NOPE:] *= gamma                 # the head's rope-slot query
    expect_kv[:, h, :NOPE] *= math.sqrt(gamma)     # W_k^C; values untouched

  clipped = nnx.jit(lambda m, lm: m.clip_qk(lm, tau))(mla, jnp.asarray(s_max, jnp.float32))
  assert int(clipped) == over.sum()
  np.testing.assert_allclose(mla.wq_b.kernel[...], expect_q, rtol=1e-6)
  np.testing.assert_allclose(mla.wkv_b.kernel[...], expect_kv, rtol=1e-6)
  np.testing.assert_array_equal(mla.wkv_a.kernel[...], wkv_a)   # the shared key slot

  after = np.asarray(fwd_aux(mla, x, seg))
  np.testing.assert_allclose(after[over], tau, rtol=1e-5)        # every logit scaled by gamma
  np.testing.assert_allclose(after[~over], s_max[~over], rtol=1e-6)


def test_model_clip_reaches_every_mla_layer():
  """K3Model.qk_clip rescales each MLA layer (prefix, both stacked cycles, final) by its
  own heads' maxima; the first MLA layer, whose input the clip cannot change, then has
  every head exactly at tau."""
  cfg = micro_config()
  model = random_model(cfg.model)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 24)).astype(np.int32)
  seg = np.ones((2, 24), np.int32)
  fwd = nnx.jit(lambda m, t, s: m(t, s)[1])
  aux = fwd(model, tokens, seg)
  mlas = [(g, i, layer) for g, i, layer in model.all_layers() if layer.is_mla]
  maxima = [np.asarray(aux[g][i]["logit_max"], np.float64) for g, i, _ in mlas]
  assert [m.shape for m in maxima] == [(2,), (2, 2), (2,)]   # prefix, 2 stacked cycles, final
  tau = 0.5 * min(float(m.min()) for m in maxima)
  nope = cfg.model.mla.qk_nope_dim
  expect = []
  for (_, _, layer), s_max in zip(mlas, maxima):
    gamma = (tau / s_max)[..., None, :, None]                 # [*L, 1, H, 1]
    wq = np.asarray(layer.mixer.wq_b.kernel[...], np.float64)
    expect.append(np.concatenate([wq[..., :nope] * np.sqrt(gamma), wq[..., nope:] * gamma], -1))

  stats = nnx.jit(lambda m, a: m.qk_clip(a, tau))(model, aux)
  assert int(stats["qk_clipped_heads"]) == sum(m.size for m in maxima)
  np.testing.assert_allclose(float(stats["mla_max_logit"]), max(m.max() for m in maxima),
                             rtol=1e-6)
  for (_, _, layer), want in zip(mlas, expect):
    np.testing.assert_allclose(layer.mixer.wq_b.kernel[...], want, rtol=1e-5)
  first = fwd(model, tokens, seg)[mlas[0][0]][mlas[0][1]]["logit_max"]
  np.testing.assert_allclose(first, tau, rtol=1e-5)

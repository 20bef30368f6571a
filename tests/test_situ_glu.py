"""SiTU-GLU against its closed form (K3_SPEC 4.1), and the GLU MLP built on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.model import remat
from k3jax.model.situ_glu import GLUMLP, glu_activation, situ_glu, swiglu

B1, B2 = 4.0, 25.0


def sigmoid(x):
  return np.exp(-np.logaddexp(0.0, -x))


def situ_ref(g, v, b1=B1, b2=B2):
  """h = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(v/b2)] in float64."""
  return b1 * np.tanh(g / b1) * sigmoid(g) * b2 * np.tanh(v / b2)


def situ_grad_ref(g, v, b1=B1, b2=B2):
  """(dh/dg, dh/dv) by hand: with A(g) = b1 tanh(g/b1) sig(g), B(v) = b2 tanh(v/b2),
  A' = (1 - tanh^2(g/b1)) sig(g) + b1 tanh(g/b1) sig(g) (1 - sig(g)), B' = 1 - tanh^2(v/b2)."""
  tg, tv, sg = np.tanh(g / b1), np.tanh(v / b2), sigmoid(g)
  a, b = b1 * tg * sg, b2 * tv
  da = (1 - tg ** 2) * sg + b1 * tg * sg * (1 - sg)
  db = 1 - tv ** 2
  return da * b, a * db


def inputs(scale, n=4096, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=n) * scale, rng.normal(size=n) * scale


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_values_and_grads_match_closed_form(scale):
  g, v = inputs(scale)
  h = situ_glu(jnp.asarray(g, jnp.float32), jnp.asarray(v, jnp.float32))
  assert h.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(h), situ_ref(g, v), rtol=1e-5, atol=1e-5)
  dg, dv = jax.vmap(jax.grad(situ_glu, argnums=(0, 1)))(jnp.asarray(g, jnp.float32),
                                                        jnp.asarray(v, jnp.float32))
  rdg, rdv = situ_grad_ref(g, v)
  # fp32 autodiff forms 1 - tanh^2 near saturation: absolute error grows with the scale
  np.testing.assert_allclose(np.asarray(dg), rdg, rtol=1e-4, atol=1e-5 * scale)
  np.testing.assert_allclose(np.asarray(dv), rdv, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("name, fn", [("situ_glu", situ_glu), ("swiglu", swiglu)])
def test_the_activation_keeps_only_its_bf16_inputs_for_its_backward(name, fn):
  """recompute=True (`model.remat="elementwise"`): the activation keeps g and v for its
  backward, not autodiff's fp32 intermediates; its gradients are autodiff's, bit for bit."""
  g, v = (jnp.asarray(x, jnp.bfloat16) for x in inputs(3.0))
  act = glu_activation(name, recompute=True)
  kept = lambda f: [(x.dtype, x.shape) for x in jax.tree.leaves(jax.vjp(f, g, v)[1])]
  assert kept(act) == [(jnp.bfloat16, g.shape)] * 2
  assert (jnp.float32, g.shape) in kept(fn)   # what plain autodiff keeps
  loss = lambda f: jax.jit(jax.grad(lambda g, v: jnp.sum(jnp.sin(f(g, v))), argnums=(0, 1)))
  for got, want in zip(loss(act)(g, v), loss(fn)(g, v)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_custom_caps():
  g, v = inputs(5.0, n=256, seed=1)
  h = situ_glu(jnp.asarray(g), jnp.asarray(v), b1=2.0, b2=10.0)
  np.testing.assert_allclose(np.asarray(h), situ_ref(g, v, 2.0, 10.0), rtol=1e-5, atol=1e-5)


def test_bounded_on_large_inputs():
  big = np.array([-1e30, -1e6, -1e3, -50.0, 50.0, 1e3, 1e6, 1e30])
  g, v = np.meshgrid(big, big)
  h = situ_glu(jnp.asarray(g, jnp.float32), jnp.asarray(v, jnp.float32))
  assert np.all(np.isfinite(np.asarray(h)))
  # fp32 tanh saturates to exactly 1, so the bound b1*b2 = 100 is reached, never passed.
  assert np.max(np.abs(np.asarray(h))) <= B1 * B2
  assert np.max(np.abs(situ_ref(g[:4, :4] * 1e-2, v[:4, :4] * 1e-2))) < B1 * B2  # strict in f64
  dg, dv = jax.vmap(jax.grad(situ_glu, argnums=(0, 1)))(jnp.asarray(g.ravel(), jnp.float32),
                                                        jnp.asarray(v.ravel(), jnp.float32))
  assert np.all(np.isfinite(np.asarray(dg))) and np.all(np.isfinite(np.asarray(dv)))
  # swiglu is unbounded by contrast
  assert float(jnp.max(jnp.abs(swiglu(jnp.float32(1e3), jnp.float32(1e3))))) > 1e5


def test_equals_swiglu_to_first_order_near_zero():
  g0, v0 = inputs(1.0, n=1024, seed=2)
  errs = []
  for eps in (1e-1, 1e-2):
    g, v = jnp.asarray(g0 * eps, jnp.float32), jnp.asarray(v0 * eps, jnp.float32)
    diff = np.max(np.abs(np.asarray(situ_glu(g, v) - swiglu(g, v))))
    errs.append(diff / eps ** 2)  # both are O(eps^2); the difference is O(eps^4)
    dg = jax.vmap(jax.grad(situ_glu, argnums=(0, 1)))(g, v)
    sg = jax.vmap(jax.grad(swiglu, argnums=(0, 1)))(g, v)
    for a, b in zip(dg, sg):
      assert np.max(np.abs(np.asarray(a - b))) < 2 * eps ** 2
  assert errs[0] < 1e-2 and errs[1] < 1e-3, errs


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_glu_mlp_matches_manual(activation):
  mlp = GLUMLP(12, 20, activation=activation, rngs=nnx.Rngs(0), dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(1), (2, 3, 12))
  y = mlp(x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  g = np.asarray(x, np.float64) @ np.asarray(mlp.w_g.kernel[...], np.float64)
  v = np.asarray(x, np.float64) @ np.asarray(mlp.w_u.kernel[...], np.float64)
  h = situ_ref(g, v) if activation == "situ_glu" else g * sigmoid(g) * v
  ref = h @ np.asarray(mlp.w_d.kernel[...], np.float64)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


def test_glu_mlp_axes_and_dtypes():
  mlp = GLUMLP(8, 16, activation="situ_glu", axes_in="latent", rngs=nnx.Rngs(0),
               dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert mlp.w_g.kernel.get_metadata()["out_sharding"] == ("latent", "mlp")
  assert mlp.w_u.kernel.get_metadata()["out_sharding"] == ("latent", "mlp")
  assert mlp.w_d.kernel.get_metadata()["out_sharding"] == ("mlp", "latent")
  assert mlp.w_g.kernel[...].dtype == jnp.float32
  assert mlp(jnp.ones((2, 8))).dtype == jnp.bfloat16
  with pytest.raises(ValueError):
    GLUMLP(8, 16, activation="relu", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("save,kept", [
    ("glu_proj", ["bf16[2,3,16] named 'glu_proj'"] * 2),
    ("glu_proj,glu_out", ["bf16[2,3,16] named 'glu_proj'"] * 2
     + ["bf16[2,3,16] named 'glu_out'"])])
def test_remat_keeps_the_named_glu_values(save, kept, capsys):
  """Under a remat region that saves nothing else, `glu_proj` keeps x W_g and x W_u and
  `glu_out` the activation h (W_d's input), so the backward does not form h again."""
  mlp = GLUMLP(8, 16, activation="situ_glu", rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(mlp)

  def loss(state, x):
    y = remat.wrap(lambda s, x: nnx.merge(graphdef, s)(x), "full", save)(state, x)
    return jnp.sum(y.astype(jnp.float32))

  jax.ad_checkpoint.print_saved_residuals(loss, state, jnp.ones((2, 3, 8), jnp.bfloat16))
  named = sorted(line.split(" from ")[0] for line in capsys.readouterr().out.splitlines()
                 if " named " in line)
  assert named == sorted(kept)

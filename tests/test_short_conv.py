"""KDA's short convolution (`pallas_kernels.short_conv`): the kernels against the plain-JAX
reference, packed vs unpacked documents, sharded vs unsharded, and the layer's choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel
from pallas_kernels.short_conv import short_conv, short_conv_pallas, short_conv_reference


def _inputs(B, T, H, D, W, seed=0, dtype=jnp.float32, docs=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
  w = jnp.asarray(rng.uniform(-0.5, 0.5, (W, H, D)), jnp.float32)
  seg = jnp.asarray(np.sort(rng.integers(1, docs + 1, (B, T)), axis=1), jnp.int32)
  dy = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
  return x, w, seg, dy


def _value_and_grads(fn, x, w, seg, dy, **kw):
  def loss(x, w):
    return jnp.sum(fn(x, w, seg, **kw).astype(jnp.float32) * dy.astype(jnp.float32))
  y = fn(x, w, seg, **kw)
  return (y,) + jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("shape,normalize", [
    ((2, 50, 2, 16, 4), True),     # T not a multiple of the row block
    ((1, 40, 3, 24, 3), False),    # D not a power of two, three taps
    ((2, 64, 2, 32, 4), False),
    ((1, 70, 1, 128, 2), True),    # a full head, two taps
])
def test_kernel_matches_reference(shape, normalize):
  """fp32: output, input gradient and tap gradients equal the reference's to rounding,
  with documents packed in each row."""
  args = _inputs(*shape)
  interp = lambda *a, **kw: short_conv_pallas(*a, interpret=True, **kw)
  got = _value_and_grads(interp, *args, normalize=normalize)
  want = _value_and_grads(short_conv_reference, *args, normalize=normalize)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert rel(a, b) < 2e-6, (name, rel(a, b))


def test_bf16_kernel_is_as_accurate_as_the_reference():
  """bf16 activations: both forms compute in fp32 and round once at the end, so both are
  within bf16 rounding of the fp32 result and agree with each other as closely."""
  x, w, seg, dy = _inputs(2, 96, 2, 64, 4, seed=1, dtype=jnp.bfloat16)
  exact = _value_and_grads(short_conv_reference, x.astype(jnp.float32), w, seg,
                           dy.astype(jnp.float32), normalize=True)
  ref = _value_and_grads(short_conv_reference, x, w, seg, dy, normalize=True)
  got = _value_and_grads(lambda *a, **kw: short_conv_pallas(*a, interpret=True, **kw),
                         x, w, seg, dy, normalize=True)
  for name, a, b, e in zip(("y", "dx", "dw"), got, ref, exact):
    assert a.dtype == b.dtype, name
    assert rel(a, e) < 4e-3 and rel(b, e) < 4e-3, (name, rel(a, e), rel(b, e))
    assert rel(a, b) < 4e-3, (name, rel(a, b))


def test_dp_stored_in_bf16_rounds_only_the_input_gradient():
  """dp in bf16 (the default for bf16 x): y and the tap gradients (summed from dp in fp32
  inside the kernel) are the fp32-dp kernel's; dx takes one more bf16 rounding, still within
  bf16 accuracy."""
  x, w, seg, dy = _inputs(2, 96, 2, 64, 4, seed=1, dtype=jnp.bfloat16)
  exact = _value_and_grads(short_conv_reference, x.astype(jnp.float32), w, seg,
                           dy.astype(jnp.float32), normalize=True)
  run = lambda dp: _value_and_grads(
      lambda *a, **kw: short_conv_pallas(*a, interpret=True, dp_dtype=dp, **kw), x, w, seg,
      dy, normalize=True)
  (y32, dx32, dw32), (y16, dx16, dw16) = run("float32"), run(None)
  np.testing.assert_array_equal(y16, y32)
  np.testing.assert_array_equal(dw16, dw32)
  assert 0 < rel(dx16, dx32) < 4e-3 and rel(dx16, exact[1]) < 4e-3, (
      rel(dx16, dx32), rel(dx16, exact[1]))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_packed_documents_equal_separate_rows(backend):
  """A row packing two documents gives each the output and gradients it gets alone: no tap
  reads across the boundary, forward or backward."""
  x, w, _, dy = _inputs(1, 40, 2, 16, 4, seed=2)
  cut = 13
  seg = jnp.asarray([[1] * cut + [2] * (40 - cut)], jnp.int32)
  fn = lambda x, w, s, dy: _value_and_grads(
      lambda *a, **kw: short_conv(*a, backend=backend, **kw), x, w, s, dy, normalize=True)
  packed = fn(x, w, seg, dy)
  parts = [fn(x[:, a:b], w, seg[:, a:b], dy[:, a:b]) for a, b in ((0, cut), (cut, 40))]
  np.testing.assert_allclose(packed[0], jnp.concatenate([p[0] for p in parts], 1), atol=1e-6)
  np.testing.assert_allclose(packed[1], jnp.concatenate([p[1] for p in parts], 1), atol=1e-6)
  np.testing.assert_allclose(packed[2], parts[0][2] + parts[1][2], rtol=1e-5, atol=1e-6)


def test_tap_gradients_sum_in_fp32():
  """The taps' gradients are fp32 sums over all positions: from bf16 activations they
  equal those from the same values in fp32 (summed in bf16 they were 1.2% off at 8k
  positions); the output keeps the activations' dtype. Reference at 8k positions, the
  kernel at 2k (interpret mode is slow)."""
  for fn, T in ((short_conv_reference, 4096),
                (lambda *a: short_conv_pallas(*a, interpret=True), 1024)):
    x, w, seg, dy = _inputs(2, T, 2, 32, 4, seed=3, dtype=jnp.bfloat16, docs=2)
    loss = lambda w, x, dy, fn=fn: jnp.sum(fn(x, w, seg).astype(jnp.float32) * dy)
    grad = jax.jit(jax.grad(loss))
    exact = grad(w, x.astype(jnp.float32), dy.astype(jnp.float32))
    assert rel(grad(w, x, dy), exact) < 1e-5
    assert fn(x, w, seg).dtype == jnp.bfloat16


def test_sharded_equals_unsharded():
  """Under a (batch 2 x heads 4) mesh of 8 devices the kernels run per device under
  shard_map and give the unsharded result and gradients."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  x, w, seg, dy = _inputs(2, 32, 4, 16, 4, seed=4)
  kw = dict(normalize=True, backend="interpret")
  sharded = lambda *a, **k: short_conv(*a, mesh=mesh, batch_axis="data", head_axis="model",
                                       **k)
  x = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
  got = jax.jit(lambda *a: _value_and_grads(sharded, *a, **kw))(x, w, seg, dy)
  want = _value_and_grads(short_conv, x, w, seg, dy, **kw)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_dispatcher():
  """"auto" is the kernel on GPU only (Mosaic cannot gather rows); unknown backends and
  mismatched shapes are named."""
  x, w, seg, _ = _inputs(1, 16, 2, 16, 4)
  has_kernel = lambda p: "pallas_call" in str(jax.make_jaxpr(
      lambda x: short_conv(x, w, seg, backend="auto", platform=p))(x))
  assert has_kernel("gpu") and has_kernel("cuda")
  assert not has_kernel("tpu") and not has_kernel("cpu")
  with pytest.raises(ValueError, match="unknown short-conv backend 'triton'"):
    short_conv(x, w, seg, backend="triton")
  for backend in ("reference", "kernel"):  # [W, 1, D] would broadcast over the heads
    with pytest.raises(ValueError, match=r"needs weight \[W, 2, 16\]"):
      short_conv(x, w[:, :1], seg, backend=backend)
    with pytest.raises(ValueError, match=r"segment_ids \[1, 16\]"):
      short_conv(x, w, seg[:, :8], backend=backend)


@pytest.mark.parametrize("convs", [1, 3])
def test_lowers_for_cuda(convs):
  """Forward and backward lower to Triton for CUDA (no GPU needed): the forward kernel,
  then dp with the taps' block sums, then dx; once however many convs of the same shapes a
  program makes (each distinct call is lowered once)."""
  sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)

  def loss(x, w, seg):
    return sum(jnp.sum(short_conv_pallas(x, w * (i + 1), seg, normalize=True).astype(
        jnp.float32)) for i in range(convs))

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(
      sd(2, 300, 4, 128), sd(4, 4, 128, dt=jnp.float32), sd(2, 300, dt=jnp.int32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3


def test_layer_conv_backends_agree():
  """The KDA layer gives the same output and gradients with the conv kernels (interpret
  mode) as with the reference (fp32 micro model, two documents), to fp32 rounding (the two
  sum the taps in different orders)."""
  from conftest import micro_config  # noqa: PLC0415

  from k3jax.model.kda import KDA  # noqa: PLC0415
  cfg = micro_config().model
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 24, cfg.d_model)), jnp.float32)
  seg = jnp.asarray([[1] * 10 + [2] * 14] * 2, jnp.int32)
  results = []
  for backend in ("reference", "interpret"):
    cfg.kda.conv_backend = backend
    graph, params = nnx.split(KDA(cfg, rngs=nnx.Rngs(0)))

    def loss(p, x, graph=graph):
      return jnp.sum(nnx.merge(graph, p)(x, seg)[0] ** 2)

    results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x))
  (l0, (p0, x0)), (l1, (p1, x1)) = results
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves((x1, p1)), jax.tree.leaves((x0, p0))):
    assert rel(a, b) < 1e-5, rel(a, b)

"""The Block AttnRes read's kernels (`pallas_kernels.attn_res`): kernel vs reference
(forward and every gradient, masked sources, bf16), sharded vs unsharded, the dispatcher's
choice, the Triton lowering, and the model's read through them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel
from pallas_kernels.attn_res import attend, attend_pallas, attend_reference

EPS = 1e-5


def _inputs(S, B, T, d, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  sources = jnp.asarray(2 * rng.standard_normal((S, B, T, d)), dtype)
  query = jnp.asarray(rng.standard_normal(d), jnp.float32)
  gain = jnp.asarray(1 + 0.3 * rng.standard_normal(d), jnp.float32)
  dh = jnp.asarray(rng.standard_normal((B, T, d)), dtype)
  return sources, query, gain, dh


def _value_and_grads(fn, sources, valid, query, gain, dh, **kw):
  def loss(sources, query, gain):
    h = fn(sources, valid, query, gain, EPS, **kw)
    return jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32))
  return (fn(sources, valid, query, gain, EPS, **kw),) + jax.grad(
      loss, argnums=(0, 1, 2))(sources, query, gain)


@pytest.mark.parametrize("S,B,T,d,valid", [
    (5, 2, 16, 64, (1, 1, 0, 1, 0)),    # masked slots, k3_small's 5 slots
    (3, 1, 48, 48, None),               # all valid; d a multiple of 16, not of 32
    (2, 4, 8, 512, (1, 0)),             # only the embedding: alpha = 1, several d-tiles
])
def test_kernel_matches_reference(S, B, T, d, valid):
  sources, query, gain, dh = _inputs(S, B, T, d, seed=S + d)
  valid = None if valid is None else jnp.asarray(valid, bool)
  got = _value_and_grads(attend_pallas, sources, valid, query, gain, dh, interpret=True)
  want = _value_and_grads(attend_reference, sources, valid, query, gain, dh)
  for name, a, b in zip(("h", "d_sources", "d_query", "d_gain"), got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
  if valid is not None:   # a masked slot gets exactly no gradient
    assert not np.any(np.asarray(got[1])[~np.asarray(valid)])


def test_bf16_kernel_is_as_accurate_as_the_reference():
  """bf16 sources: both compute in fp32 and round h and d_sources to bf16 once."""
  sources, query, gain, dh = _inputs(5, 2, 16, 128, seed=7, dtype=jnp.bfloat16)
  valid = jnp.asarray([1, 1, 1, 0, 1], bool)
  exact = _value_and_grads(attend_reference, sources.astype(jnp.float32), valid, query, gain,
                           dh.astype(jnp.float32))
  got = _value_and_grads(attend_pallas, sources, valid, query, gain, dh, interpret=True)
  ref = _value_and_grads(attend_reference, sources, valid, query, gain, dh)
  assert got[0].dtype == got[1].dtype == jnp.bfloat16
  for a, b, e in zip(got, ref, exact):
    assert rel(a, e) <= 1.5 * rel(b, e) + 1e-6


@pytest.mark.parametrize("separate", [False, True])
def test_sharded_equals_unsharded(separate):
  """Under a (batch 2 x seq 4) mesh of 8 devices the kernels run per device under
  shard_map and give the unsharded result and gradients (query and gain summed over
  every device's tokens); the sources as one buffer or as separate arrays."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
  sources, query, gain, dh = _inputs(4, 2, 64, 32, seed=3)
  valid = jnp.asarray([1, 1, 0, 1], bool)
  sharded = lambda *a, **k: attend(*a, mesh=mesh, batch_axis="data", seq_axis="context",
                                   **k)
  sources = jax.device_put(sources, NamedSharding(mesh, P(None, "data", "context")))
  if separate:
    sources, valid = [sources[0], sources[1], sources[3]], None
  got = jax.jit(lambda *a: _value_and_grads(sharded, *a, backend="interpret"))(
      sources, valid, query, gain, dh)
  want = _value_and_grads(attend, sources, valid, query, gain, dh, backend="reference")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_dispatcher():
  """"auto" is the kernel on GPU where the per-device shapes fit it, else the reference;
  unknown backends and mismatched shapes are named."""
  sources, query, gain, _ = _inputs(3, 2, 16, 32)
  has_kernel = lambda s, p: "pallas_call" in str(jax.make_jaxpr(
      lambda s: attend(s, None, query, gain, EPS, backend="auto", platform=p))(s))
  assert has_kernel(sources, "gpu") and has_kernel(sources, "cuda")
  assert not has_kernel(sources, "tpu") and not has_kernel(sources, "cpu")
  assert not has_kernel(sources[:, :, :3], "gpu")          # 6 tokens: not a block of 16
  with pytest.raises(ValueError, match="unknown attn-res backend 'triton'"):
    attend(sources, None, query, gain, EPS, backend="triton")
  with pytest.raises(ValueError, match=r"need d % 16 == 0"):
    attend(sources[..., :24], None, query[:24], gain[:24], EPS, backend="interpret")
  for backend in ("reference", "interpret"):
    with pytest.raises(ValueError, match=r"valid must be \[S\] = \[3\]"):
      attend(sources, jnp.ones((4,), bool), query, gain, EPS, backend=backend)
    with pytest.raises(ValueError, match=r"query must be \[d\] = \[32\]"):
      attend(sources, None, query[:16], gain, EPS, backend=backend)


@pytest.mark.parametrize("reads,separate", [(1, False), (3, False), (1, True)])
def test_lowers_for_cuda(reads, separate):
  """Forward and backward lower to Triton for CUDA (no GPU needed): one kernel each, however
  many reads of the same shapes a program makes (each distinct call is lowered once); the
  sources as one buffer or as separate arrays."""
  sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)

  def loss(sources, valid, query, gain):
    if separate:
      sources, valid = list(sources), None
    return sum(jnp.sum(attend_pallas(sources, valid, query * (i + 1), gain, EPS).astype(
        jnp.float32)) for i in range(reads))

  sources = [sd(2, 256, 2048)] * 3 if separate else sd(5, 2, 256, 2048)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3))).trace(
      sources, sd(5, dt=bool), sd(2048, dt=jnp.float32),
      sd(2048, dt=jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2


def test_model_reads_through_the_kernels():
  """`model.attn_res.backend` reaches every read (two a layer and the output's, the scanned
  cycle's traced once), and the micro model's loss is the reference's. Its gradients are
  not compared here: the random micro model amplifies the reads' fp32 rounding through its
  layers past fp32 tolerances; the op's gradients are held to 2e-5 above."""
  from flax import nnx  # noqa: PLC0415

  from conftest import jaxpr_eqns, micro_config, random_model  # noqa: PLC0415
  from k3jax.model.k3 import layer_plan  # noqa: PLC0415

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], 2, axis=0), jnp.int32)

  def loss_and_kernels(backend):
    cfg = micro_config().model
    cfg.attn_res.backend = backend
    cfg.moe.top_k = cfg.moe.num_experts    # no discrete pick for rounding to flip
    graph, state = nnx.split(random_model(cfg))

    def loss(state):
      logits, _ = nnx.merge(graph, state)(tokens, seg)
      return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))
    calls = sum(e.primitive.name == "pallas_call"
                for e in jaxpr_eqns(jax.make_jaxpr(loss)(state).jaxpr))
    return jax.jit(loss)(state), calls, layer_plan(cfg)

  (l_ref, calls_ref, plan), (l_k, calls_k, _) = map(loss_and_kernels, ("reference",
                                                                       "interpret"))
  traced_layers = plan.prefix + plan.cycle * (plan.num_cycles > 0) + plan.suffix
  assert calls_k - calls_ref == 2 * traced_layers + 1
  np.testing.assert_allclose(l_k, l_ref, rtol=1e-5)


@pytest.mark.parametrize("fn,kw", [(attend_pallas, {"interpret": True}), (attend_reference, {})])
def test_separate_sources_equal_the_buffers_valid_slots(fn, kw):
  """Sources given as separate arrays (an unrolled stack's `Slots`), only those that exist,
  read as the buffer with the rest masked: the same h and, for each source, the same
  gradient (to fp32 rounding: the programs differ in their number of sources)."""
  sources, query, gain, dh = _inputs(5, 2, 16, 64, seed=11)
  valid = jnp.asarray([1, 1, 1, 0, 0], bool)
  buffer = _value_and_grads(fn, sources, valid, query, gain, dh, **kw)
  slots = _value_and_grads(fn, [sources[s] for s in range(3)], None, query, gain, dh, **kw)
  assert isinstance(slots[1], list) and len(slots[1]) == 3
  for a, b in zip([slots[0], *slots[1], *slots[2:]], [buffer[0], *buffer[1][:3], *buffer[2:]]):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="one or more \\[B, T, d\\] of one shape"):
    fn([sources[0], sources[1, :, :8]], None, query, gain, EPS, **kw)

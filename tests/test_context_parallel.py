"""Context parallelism (mesh axis `context` splits every sequence's positions): the ops and
the whole model on 2, 4 and 8 simulated devices equal one device, forward and backward, with
documents that cross device boundaries and one that starts exactly at a boundary."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pallas_kernels import kda as kda_ops
from pallas_kernels import short_conv as conv_ops

pytestmark = pytest.mark.xdist_group("test_context_parallel")

CONTEXTS = (2, 4, 8)


def _mesh(context, data=1, tensor=1):
  devices = np.asarray(jax.devices()[:data * context * tensor])
  return Mesh(devices.reshape(data, context, tensor), ("data", "context", "tensor"))


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _segments(b, t):
  """Row 0: a document crossing every boundary, one starting at t / 2 (a boundary for every
  context size), a short one inside a slice; row 1: two documents, padding (0) at the end."""
  seg = np.ones((b, t), np.int32)
  seg[0, 3 * t // 16:] = 2
  seg[0, t // 2:] = 3
  seg[0, t // 2 + 5: t // 2 + 9] = 4
  seg[1, 5 * t // 8 + 3:] = 2
  seg[1, -3:] = 0
  return seg


@functools.cache
def _kda_problem(b=2, t=64, h=2, d=16):
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q, k = (unit(rng.standard_normal((b, t, h, d))).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((b, t, h, d)).astype(np.float32)
  g = (-5 / (1 + np.exp(-rng.standard_normal((b, t, h, d))))).astype(np.float32)
  beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
  h0 = (0.1 * rng.standard_normal((b, h, d, d))).astype(np.float32)
  cot_o, cot_s = rng.standard_normal((b, t, h, d)), rng.standard_normal((b, h, d, d))
  return (q, k, v, g, beta, h0), _segments(b, t), cot_o.astype(np.float32), cot_s.astype(
      np.float32)


def _kda_run(backend, **where):
  """(o, final state) and the gradients w.r.t. q, k, v, g, beta, h0 of a weighted sum."""
  args, seg, cot_o, cot_s = _kda_problem()

  def f(*args):
    o, s = kda_ops.kda(*args[:5], initial_state=args[5], segment_ids=seg, backend=backend,
                       output_final_state=True, chunk_size=16, **where)
    return jnp.sum(o * cot_o) + jnp.sum(s * cot_s), (o, s)

  (_, outs), grads = jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))(
      *args)
  return outs, grads


@pytest.mark.parametrize("context,backend,batch,heads", [
    (2, "chunk", None, None), (4, "chunk", None, None), (8, "chunk", None, None),
    (2, "chunk", "data", "tensor"), (4, "interpret", "data", None)])
def test_kda_split_over_context_equals_one_device(context, backend, batch, heads):
  """Each device runs its slice; the states entering the slices come from the chain of the
  slices' affine maps. Output, final state and every gradient (the initial state's too)
  equal the naive recurrence over the whole sequence."""
  data, tensor = (2 if batch else 1), (2 if heads else 1)
  (o1, s1), g1 = _kda_run("naive")
  (o, s), g = _kda_run(backend, mesh=_mesh(context, data, tensor), seq_axis="context",
                       batch_axis=batch, head_axis=heads)
  assert _rel(o, o1) < 1e-5 and _rel(s, s1) < 1e-5
  for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), g, g1):
    assert _rel(a, b) < 1e-5, name


def test_kda_chunk_halves_to_fit_a_slice(monkeypatch):
  """With no chunk named, a slice shorter than the backend's default chunk (64 for the
  chunk form) runs in chunks that divide it (16 tokens of 64 over 4 devices), not in one
  chunk padded with 48 tokens."""
  args, seg, _, _ = _kda_problem()
  chunks, original = [], kda_ops.kda_chunk

  def recording(*a, chunk_size, **kw):
    chunks.append(chunk_size)
    return original(*a, chunk_size=chunk_size, **kw)

  monkeypatch.setattr(kda_ops, "kda_chunk", recording)
  want = kda_ops.kda(*args[:5], segment_ids=seg, backend="naive")
  got = jax.jit(lambda *a: kda_ops.kda(*a, segment_ids=seg, backend="chunk", mesh=_mesh(4),
                                       seq_axis="context"))(*args[:5])
  assert chunks == [16] and _rel(got, want) < 1e-5


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_short_conv_takes_its_halo_from_the_previous_device(context, backend):
  """The taps read the conv_size - 1 tokens before a slice from the previous device (only
  within a document); values and gradients equal the unsplit conv."""
  rng = np.random.default_rng(1)
  b, t, h, d = 2, 64, 2, 16
  x = rng.standard_normal((b, t, h, d)).astype(np.float32)
  weight = rng.standard_normal((4, h, d)).astype(np.float32)
  seg, cot = _segments(b, t), rng.standard_normal((b, t, h, d)).astype(np.float32)

  def run(backend, **where):
    f = lambda x, w: jnp.sum(conv_ops.short_conv(  # noqa: E731
        x, w, seg, normalize=True, backend=backend, **where) * cot)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, weight)

  want, (dx1, dw1) = run("reference")
  got, (dx, dw) = run(backend, mesh=_mesh(context), seq_axis="context")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert _rel(dx, dx1) < 1e-5 and _rel(dw, dw1) < 1e-5


def test_short_conv_slice_shorter_than_its_taps_is_refused():
  x = np.zeros((1, 16, 1, 16), np.float32)
  with pytest.raises(ValueError, match="shorter than the 3 tokens"):
    conv_ops.short_conv(x, np.zeros((4, 1, 16), np.float32), np.ones((1, 16), np.int32),
                        mesh=_mesh(8), seq_axis="context")

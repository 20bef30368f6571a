"""KDA ops (pallas_kernels/kda): chunk vs naive on outputs, final state and every gradient;
awkward sizes; packed documents; bf16 inputs; naive vs an independent float64 loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import LOWER_BOUND, kda, kda_chunk, kda_naive, resolve_backend

RTOL_FP32 = 1e-4  # chunk vs naive, fp32, relative RMS
RTOL_BF16 = 1e-2  # chunk on bf16 inputs vs naive on the fp32 originals
RTOL_FP64 = 1e-5  # naive (fp32) vs float64 numpy
BACKENDS = {"reference": kda_chunk, "naive": kda_naive}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


def rel_rms(a, b):
  """||a - b|| / ||b|| (just ||a - b|| where b is all zero)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0)


def make_inputs(seed, B, T, H, K, V):
  """Realistic inputs: unit-norm q, k; g = LOWER_BOUND * sigmoid(.) in (-5, 0). Half the
  channels of batch row 0 sit near the bound over a 40-token span, and with B > 1 all of
  row 1 does: the largest intra-chunk decay sums the chunked form can meet."""
  rng = np.random.default_rng(seed)  # numpy, so that making inputs compiles nothing
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sigmoid = lambda x: 1 / (1 + np.exp(-x))
  q = unit(rng.standard_normal((B, T, H, K)))
  k = unit(rng.standard_normal((B, T, H, K)))
  v = rng.standard_normal((B, T, H, V))
  logits = rng.standard_normal((B, T, H, K))
  logits[0, T // 4:T // 4 + 40, :, :K // 2] += 9.0  # g ~ -4.999
  logits[1:] += 9.0
  g = LOWER_BOUND * sigmoid(logits)
  beta = sigmoid(rng.standard_normal((B, T, H)))
  h0 = rng.standard_normal((B, H, K, V))
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0))


def cotangents(seed, o_shape, s_shape):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(o_shape), jnp.float32),
          jnp.asarray(rng.standard_normal(s_shape), jnp.float32))


@functools.partial(jax.jit, static_argnames=("fn",))
def forward_and_grads(fn, q, k, v, g, beta, h0, cot_o, cot_s):
  """(o, final state) and the gradients of sum(cot_o o) + sum(cot_s S) w.r.t.
  q, k, v, g, beta, h0."""
  run = lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True)
  out, vjp = jax.vjp(run, q, k, v, g, beta, h0)
  return out, vjp((cot_o, cot_s))


def test_chunk_matches_naive():
  """T = 100: one full chunk and a padded one; K != V; row 1 at the gate bound."""
  B, T, H, K, V = 2, 100, 2, 32, 16
  inputs = make_inputs(0, B, T, H, K, V)
  cot = cotangents(1, (B, T, H, V), (B, H, K, V))
  (o_ref, s_ref), g_ref = forward_and_grads(kda_naive, *inputs, *cot)
  (o, s), grads = forward_and_grads(kda_chunk, *inputs, *cot)
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
  for row in range(B):  # per row, so row 1's strongly decayed values count on their own
    assert rel_rms(o[row], o_ref[row]) < RTOL_FP32, row
    assert rel_rms(s[row], s_ref[row]) < RTOL_FP32, row
    for name, a, b in zip(GRAD_NAMES, grads, g_ref):
      assert np.all(np.isfinite(a[row])), (name, row)
      assert rel_rms(a[row], b[row]) < RTOL_FP32, (name, row)


def test_unbounded_gate_chunk_matches_naive():
  """Kimi Linear's softplus gate: g unbounded below (down to -60 a token here, where the
  bounded form's factors would overflow); `bounded_gate=False` takes the diagonal tiles
  elementwise. Outputs, state and gradients equal the literal recurrence; packed
  documents too."""
  B, T, H, K, V = 2, 100, 2, 32, 16
  q, k, v, _, beta, h0 = make_inputs(12, B, T, H, K, V)
  f = np.random.default_rng(13).standard_normal((B, T, H, K)) * 3
  f[1, 20:60] += 30.0
  g = jnp.asarray(-2.0 * np.logaddexp(0.0, f), jnp.float32)      # -A softplus(f), A = 2
  assert float(g.min()) < -60 and float(g.max()) < 0
  cot = cotangents(14, (B, T, H, V), (B, H, K, V))
  unbounded = functools.partial(kda_chunk, bounded_gate=False)
  for segment_ids in (None, packed_segment_ids()):
    naive = functools.partial(kda_naive, segment_ids=segment_ids)
    chunk = functools.partial(unbounded, segment_ids=segment_ids)
    (o_ref, s_ref), g_ref = forward_and_grads(naive, q, k, v, g, beta, h0, *cot)
    (o, s), grads = forward_and_grads(chunk, q, k, v, g, beta, h0, *cot)
    for row in range(B):
      assert rel_rms(o[row], o_ref[row]) < RTOL_FP32, row
      assert rel_rms(s[row], s_ref[row]) < RTOL_FP32, row
      for name, a, b in zip(GRAD_NAMES, grads, g_ref):
        assert np.all(np.isfinite(a[row])), (name, row)
        assert rel_rms(a[row], b[row]) < RTOL_FP32, (name, row)


def test_return_structure():
  q, k, v, g, beta, _ = make_inputs(4, 1, 20, 2, 16, 8)
  for fn in BACKENDS.values():
    o = jax.eval_shape(fn, q, k, v, g, beta)
    assert isinstance(o, jax.ShapeDtypeStruct) and o.shape == (1, 20, 2, 8)
    o, s = jax.eval_shape(functools.partial(fn, output_final_state=True), q, k, v, g, beta)
    assert o.shape == (1, 20, 2, 8) and s.shape == (1, 2, 16, 8) and s.dtype == jnp.float32


# Documents per batch row (lengths). Ids repeat across separate runs on purpose: a run of
# equal ids is a document, the same id later is a new one. Row 1 has a boundary on a chunk
# edge, row 0 a one-token document.
DOC_LENGTHS = [[37, 1, 45, 17], [64, 36]]
DOC_IDS = [[5, 2, 5, 9], [1, 2]]


def packed_segment_ids():
  rows = [np.repeat(ids, lens) for ids, lens in zip(DOC_IDS, DOC_LENGTHS)]
  return jnp.asarray(np.stack(rows), jnp.int32)  # [2, 100]


def documents_alone(x):
  """[B, T, ...] packed -> [D, T, ...]: document d at the start of row d, then zeros.
  Later tokens cannot change a document's outputs (causality), and zero tokens (g = 0,
  beta = 0) leave its final state unchanged."""
  x = np.asarray(x)
  rows = []
  for row, lengths in enumerate(DOC_LENGTHS):
    start = 0
    for n in lengths:
      rows.append(np.zeros_like(x[row]))
      rows[-1][:n] = x[row, start:start + n]
      start += n
  return np.stack(rows)


def test_packed_documents():
  """Rows 0-1 hold packed documents, rows 2-7 each document alone. For both backends: a
  packed document's outputs equal its outputs alone, a row's final state is its last
  document's, and no gradient crosses a document boundary (exactly zero). And chunk (with
  other tile sizes: chunk 32, sub-chunk 8, T = 100 not a multiple) matches naive on
  outputs, final states and every gradient."""
  q, k, v, g, beta, h0 = make_inputs(5, 2, 100, 2, 16, 8)
  D = sum(map(len, DOC_LENGTHS))
  both = lambda x: jnp.concatenate([x, documents_alone(x)])
  first = 2 + np.cumsum([0] + [len(x) for x in DOC_LENGTHS[:-1]])  # each row's document 0
  h0_all = np.zeros((2 + D, *h0.shape[1:]), np.float32)
  h0_all[:2] = h0_all[first] = h0  # the initial state feeds document 0 only
  seg = jnp.concatenate([packed_segment_ids(), jnp.zeros((D, 100), jnp.int32)])
  args = (*map(both, (q, k, v, g, beta)), jnp.asarray(h0_all))
  start, stop = 38, 83  # row 0, document 2 (length 45)
  cot_o, cot_s = cotangents(7, args[2].shape, h0_all.shape)
  cot_o = jnp.zeros_like(cot_o).at[0, start:stop].set(cot_o[0, start:stop])
  cot_s = jnp.zeros_like(cot_s).at[:2].set(cot_s[:2])

  @functools.partial(jax.jit, static_argnames="fn")
  def run_and_grads(fn, *args):
    run = lambda *a: fn(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True)
    out, vjp = jax.vjp(run, *args)
    cots = (jnp.stack([cot_o, jnp.zeros_like(cot_o)]),
            jnp.stack([jnp.zeros_like(cot_s), cot_s]))
    return out, jax.vmap(vjp)(cots)  # one backward pass for both cotangents

  results = {}
  for backend, fn in [("naive", kda_naive),
                      ("reference", functools.partial(kda_chunk, chunk_size=32, sub_chunk_size=8))]:
    (o, s), grads = results[backend] = run_and_grads(fn, *args)
    d = 2
    for row, lengths in enumerate(DOC_LENGTHS):
      t = 0
      for n in lengths:
        assert rel_rms(o[row, t:t + n], o[d, :n]) < RTOL_FP32, (backend, row, d)
        t, d = t + n, d + 1
      assert rel_rms(s[row], s[d - 1]) < RTOL_FP32, (backend, row)  # last document's

    for name, grad in zip(GRAD_NAMES[:5], grads[:5]):
      a, b = np.asarray(grad[0]), np.asarray(grad[1])
      # outputs of row 0's document 2 depend on its own tokens only, exactly
      assert np.all(a[0, :start] == 0) and np.all(a[0, stop:] == 0), (backend, name)
      assert np.all(a[1:] == 0) and np.any(a[0, start:stop] != 0), (backend, name)
      # each row's final state depends on its last document only (from 83 and 64)
      assert np.all(b[0, :83] == 0) and np.all(b[1, :64] == 0), (backend, name)
      if name != "q":  # (the state does not depend on q)
        assert np.any(b[0, 83:] != 0) and np.any(b[1, 64:] != 0), (backend, name)
    assert np.all(np.asarray(grads[5]) == 0), backend  # h0 belongs to document 0

  for a, b in zip(jax.tree.leaves(results["reference"]), jax.tree.leaves(results["naive"])):
    assert rel_rms(a, b) < RTOL_FP32


def test_bf16_inputs():
  """bf16 q, k, v, g, beta into chunk vs fp32 naive; T = 63, shorter than one chunk."""
  q, k, v, g, beta, _ = make_inputs(8, 2, 63, 2, 32, 32)  # (no initial state here)
  o_ref, s_ref = jax.jit(functools.partial(kda_naive, output_final_state=True))(q, k, v, g, beta)
  bf = lambda x: x.astype(jnp.bfloat16)
  o, s = jax.jit(functools.partial(kda_chunk, output_final_state=True))(
      bf(q), bf(k), bf(v), bf(g), bf(beta))
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  for row in range(2):
    assert rel_rms(o[row], o_ref[row]) < RTOL_BF16, row
    assert rel_rms(s[row], s_ref[row]) < RTOL_BF16, row


def naive_float64(q, k, v, g, beta, scale, h0, segment_ids):
  """Independent float64 loop over batch, head and time."""
  q, k, v, g, beta, h0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
  B, T, H, _ = q.shape
  o = np.zeros(v.shape)
  S = h0.copy()
  for b in range(B):
    for h in range(H):
      state = S[b, h]
      for t in range(T):
        if t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
          state = np.zeros_like(state)
        state = np.exp(g[b, t, h])[:, None] * state
        err = v[b, t, h] - state.T @ k[b, t, h]
        state = state + beta[b, t, h] * np.outer(k[b, t, h], err)
        o[b, t, h] = state.T @ (scale * q[b, t, h])
      S[b, h] = state
  return o, S


def test_naive_matches_float64():
  q, k, v, g, beta, h0 = make_inputs(9, 2, 11, 2, 4, 3)
  seg = np.array([[0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0], [3] * 11])
  o_ref, s_ref = naive_float64(q, k, v, g, beta, 0.7, h0, seg)
  o, s = kda_naive(q, k, v, g, beta, scale=0.7, initial_state=h0, segment_ids=jnp.asarray(seg),
                   output_final_state=True)
  assert rel_rms(o, o_ref) < RTOL_FP64
  assert rel_rms(s, s_ref) < RTOL_FP64


def test_dispatcher():
  q, k, v, g, beta, h0 = make_inputs(10, 1, 20, 1, 8, 8)
  for backend, fn in BACKENDS.items():  # the same computation, traced (not compiled)
    trace = lambda f, **kw: str(jax.make_jaxpr(functools.partial(
        f, initial_state=h0, output_final_state=True, scale=0.3, **kw))(q, k, v, g, beta))
    assert trace(kda, backend=backend) == trace(fn)
  with pytest.raises(ValueError, match="reference.*naive"):
    kda(q, k, v, g, beta, backend="pallas")
  with pytest.raises(ValueError, match="'chunk' was renamed 'reference'"):
    kda(q, k, v, g, beta, backend="chunk")
  assert resolve_backend("auto", "gpu") == resolve_backend("auto", "tpu") == "kernel"
  assert resolve_backend("auto", "cpu") == "reference"


def test_chunk_rejects_bad_tile_sizes():
  q, k, v, g, beta, _ = make_inputs(11, 1, 20, 1, 8, 8)
  with pytest.raises(ValueError, match="multiple"):
    kda_chunk(q, k, v, g, beta, chunk_size=64, sub_chunk_size=24)
  with pytest.raises(ValueError, match="gate bound"):
    kda_chunk(q, k, v, g, beta, chunk_size=64, sub_chunk_size=32)

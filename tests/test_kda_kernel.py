"""KDA Pallas kernels (pallas_kernels/kda/pallas.py) in interpret mode against the naive
recurrence: outputs, final state and every gradient (q, k, v, g, beta, initial state); T not
a multiple of the chunk, packed documents, bf16 with fla's tolerances, K/V other than 128
(and not powers of two); the dispatcher's new backends; lowering for CUDA from this CPU.

Interpret mode starts every kernel output as NaN, so an element a kernel never writes fails
the finiteness checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_eqns
from test_kda_ops import (DOC_LENGTHS, GRAD_NAMES, cotangents, make_inputs,
                          packed_segment_ids, rel_rms)

from pallas_kernels.kda import default_chunk_size, kda, kda_chunk, kda_naive, kda_pallas

RTOL_FP32 = 1e-4  # kernel vs naive, fp32, relative RMS
# bf16 inputs vs the fp32 naive recurrence on the same (bf16-rounded) values; fla's bounds
RTOL_BF16 = {"o": 5e-3, "state": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3,
             "g": 2e-2, "beta": 2e-2}
interpret = functools.partial(kda_pallas, interpret=True)
# XLA:CPU at -O0 compiles the interpreted kernels ~3x faster; these shapes run in ms anyway.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_fast(fn, *args):
  return jax.jit(fn).trace(*args).lower().compile(FAST_COMPILE)


def forward_and_grads_compiled(fn, *args):
  """Compiled (at -O0) map from (q, k, v, g, beta, h0, cot_o, cot_s) to (o, final state)
  and the gradients of sum(cot_o o) + sum(cot_s S) w.r.t. q, k, v, g, beta, h0."""
  def run(q, k, v, g, beta, h0, cot_o, cot_s):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True),
                       q, k, v, g, beta, h0)
    return out, vjp((cot_o, cot_s))
  return compile_fast(run, *args)


def forward_and_grads(fn, *args):
  return forward_and_grads_compiled(fn, *args)(*args)


def check(out, grads, out_ref, grads_ref, rtol, rows):
  """Per batch row: finite, and within rtol (a float or a dict by name) of the reference."""
  names = ("o", "state") + GRAD_NAMES
  tol = rtol if isinstance(rtol, dict) else dict.fromkeys(names, rtol)
  for name, a, b in zip(names, (*out, *grads), (*out_ref, *grads_ref)):
    for row in range(rows):
      assert np.all(np.isfinite(np.asarray(a[row], np.float32))), (name, row)
      err = rel_rms(np.asarray(a[row], np.float32), b[row])
      assert err < tol[name], (name, row, err)


def test_kernel_matches_naive():
  """T = 100: one full chunk and a padded one; K != V; row 1 at the gate bound."""
  B, T, H, K, V = 2, 100, 2, 32, 16
  inputs = make_inputs(0, B, T, H, K, V)
  cot = cotangents(1, (B, T, H, V), (B, H, K, V))
  out_ref, grads_ref = forward_and_grads(kda_naive, *inputs, *cot)
  out, grads = forward_and_grads(interpret, *inputs, *cot)
  assert out[0].shape == (B, T, H, V) and out[0].dtype == jnp.float32
  assert out[1].shape == (B, H, K, V) and out[1].dtype == jnp.float32
  check(out, grads, out_ref, grads_ref, RTOL_FP32, B)


def test_kernel_chunk16_one_subtile():
  """Chunks of 16 with sub-tiles of 16 (the GPU default: one diagonal tile per chunk, no
  block-doubling merge), T = 50 (the last chunk padded), K != V: equal to naive."""
  B, T, H, K, V = 1, 50, 2, 32, 16
  inputs = make_inputs(4, B, T, H, K, V)
  cot = cotangents(6, (B, T, H, V), (B, H, K, V))
  out_ref, grads_ref = forward_and_grads(kda_naive, *inputs, *cot)
  fn = functools.partial(interpret, chunk_size=16, sub_chunk_size=16)
  out, grads = forward_and_grads(fn, *inputs, *cot)
  check(out, grads, out_ref, grads_ref, RTOL_FP32, B)


def bf16_against_naive(B, T, H, K, V, **kernel):
  """The kernels (interpret mode, `kernel` keywords) on bf16 inputs: outputs and gradients,
  checked against the fp32 naive recurrence on the same values with fla's tolerances."""
  inputs = [x.astype(jnp.bfloat16) for x in make_inputs(2, B, T, H, K, V)[:5]]
  h0 = make_inputs(2, B, T, H, K, V)[5]
  cot = cotangents(3, (B, T, H, V), (B, H, K, V))
  up = [x.astype(jnp.float32) for x in inputs]
  out_ref, grads_ref = forward_and_grads(kda_naive, *up, h0, *cot)
  fn = functools.partial(interpret, **kernel)
  out, grads = forward_and_grads(fn, *inputs, h0, cot[0].astype(jnp.bfloat16), cot[1])
  check(out, grads, out_ref, grads_ref, RTOL_BF16, B)
  return out, grads


def test_kernel_bf16_recompute():
  """bf16 inputs, K = V = 64, 3 heads, T = 150 (chunks of 32, the last padded), V split in
  two blocks (four where rec_fwd saves states), chunk states recomputed in the backward:
  within fla's bf16 tolerances of the fp32 recurrence on the same values."""
  out, grads = bf16_against_naive(2, 150, 3, 64, 64, chunk_size=32, block_v=32,
                                  save_states=False, states_block_v=16, states_warps=2)
  assert out[0].dtype == jnp.bfloat16 and out[1].dtype == jnp.float32
  assert [x.dtype for x in grads] == [jnp.bfloat16] * 5 + [jnp.float32]


def test_bf16_gate_gradient_is_as_accurate_as_the_others():
  """bf16 q, k, v, beta and an fp32 gate as the model's layer passes it, the gate strongly
  decaying (mean -4.4 of the bound -5, as benchmarks/kda.py draws it), chunks of 16 and 32:
  against the fp32 recurrence on the same values, dg is as close as dq and dk are (2.5e-3
  here, dq 3.0e-3). Rounding the score products' operands to bf16 in the backward put dg at
  5.8e-3."""
  B, T, H, D = 1, 128, 2, 64
  rng = np.random.default_rng(0)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (unit(f(B, T, H, D)), unit(f(B, T, H, D)),
                                                   f(B, T, H, D)))
  g = jnp.asarray(-5.0 / (1.0 + np.exp(-f(B, T, H, D) - 2.0)), jnp.float32)
  beta = jnp.asarray(1.0 / (1.0 + np.exp(-f(B, T, H))), jnp.bfloat16)
  h0, cot_o, cot_s = 0.1 * f(B, H, D, D), f(B, T, H, D), 0.1 * f(B, H, D, D)
  up = lambda x: x.astype(jnp.float32)
  _, ref = forward_and_grads(kda_naive, up(q), up(k), up(v), g, up(beta), h0, cot_o, cot_s)
  for chunk in (16, 32):
    fn = functools.partial(interpret, chunk_size=chunk)
    _, grads = forward_and_grads(fn, q, k, v, g, beta, h0, cot_o.astype(jnp.bfloat16), cot_s)
    err = {n: rel_rms(np.asarray(a, np.float32), b) for n, a, b in zip(GRAD_NAMES, grads, ref)}
    assert err["g"] < 3e-3 and err["g"] < 1.25 * min(err["q"], err["k"]), (chunk, err)


@pytest.mark.parametrize("n_spans, save_states", [(4, True), (2, False)])
def test_spans_match_naive(n_spans, save_states):
  """The recurrences cut into spans (spans.py: each span's transition, the chain through
  them, every span from the state entering it), chunks of 16, K = 32 != V = 16: packed rows
  (row 1's boundary on a span edge), an initial state, T = 100 padded to whole spans;
  outputs, final state and every gradient vs naive, fp32. With the chunk states recomputed
  the backward builds the transitions anew."""
  q, k, v, g, beta, h0 = make_inputs(8, 2, 100, 2, 32, 16)
  seg = packed_segment_ids()
  cot = cotangents(9, v.shape, h0.shape)
  out_ref, grads_ref = forward_and_grads(functools.partial(kda_naive, segment_ids=seg),
                                         q, k, v, g, beta, h0, *cot)
  fn = functools.partial(interpret, chunk_size=16, segment_ids=seg, spans=n_spans,
                         save_states=save_states)
  out, grads = forward_and_grads(fn, q, k, v, g, beta, h0, *cot)
  check(out, grads, out_ref, grads_ref, RTOL_FP32, 2)


def test_spans_bf16():
  """bf16 inputs in 4 spans of chunks of 16, K = V = 64 in V blocks of 32 and transition
  rows in blocks of 32 (two blocks of P's rows, two of R's): within fla's bf16 tolerances
  of the fp32 recurrence on the same values, as one span is."""
  bf16_against_naive(1, 150, 2, 64, 64, chunk_size=16, block_v=32, spans=4,
                     transition_block=32)


def test_kernel_packed_documents():
  """Packed rows (segment ids; a one-token document, a boundary on a chunk edge) vs naive on
  outputs, final states and all gradients, with chunk 32 / sub-tile 8; and no gradient
  crosses a document boundary: the loss on row 0's document 2 (tokens 38-82) has exactly
  zero gradient outside it, and the initial state feeds document 0 only."""
  q, k, v, g, beta, h0 = make_inputs(5, 2, 100, 2, 16, 16)
  seg = packed_segment_ids()
  cot_o, cot_s = cotangents(7, v.shape, h0.shape)
  fn = functools.partial(interpret, chunk_size=32, sub_chunk_size=8, segment_ids=seg)
  naive = functools.partial(kda_naive, segment_ids=seg)
  out_ref, grads_ref = forward_and_grads(naive, q, k, v, g, beta, h0, cot_o, cot_s)
  run = forward_and_grads_compiled(fn, q, k, v, g, beta, h0, cot_o, cot_s)
  out, grads = run(q, k, v, g, beta, h0, cot_o, cot_s)
  check(out, grads, out_ref, grads_ref, RTOL_FP32, 2)

  start, stop = 38, 83
  one_doc = jnp.zeros_like(cot_o).at[0, start:stop].set(cot_o[0, start:stop])
  _, grads = run(q, k, v, g, beta, h0, one_doc, jnp.zeros_like(cot_s))
  for name, grad in zip(GRAD_NAMES[:5], grads[:5]):
    a = np.asarray(grad)
    assert np.all(a[0, :start] == 0) and np.all(a[0, stop:] == 0), name
    assert np.all(a[1] == 0) and np.any(a[0, start:stop] != 0), name
  assert np.all(np.asarray(grads[5]) == 0)  # h0 feeds document 0 of each row only
  assert sum(DOC_LENGTHS[0]) == 100 and DOC_LENGTHS[0][:2] == [37, 1]


@pytest.mark.parametrize("chunk,sub,docs,bounded", [
    (16, 16, [16], True), (16, 8, [5, 1, 10], True), (32, 8, [3, 20, 9], True),
    (64, 16, [30, 34], True), (16, 16, [16], False), (32, 8, [3, 20, 9], False)])
def test_hand_derived_prep_vjp_is_autodiff(chunk, sub, docs, bounded):
  """`tile.chunk_prep_vjp` (the backward kernel's maths, derived by hand) equals `jax.vjp` of
  `tile.chunk_prep` on one chunk, fp32, HIGHEST: one diagonal tile or several, documents
  starting inside the chunk (one of a single token), state-seeing and last-document masks;
  the bounded gate (g in [-5, 0]) and an unbounded one (down to -40 a token)."""
  from jax import lax  # noqa: PLC0415

  from pallas_kernels.kda import tile  # noqa: PLC0415
  rng = np.random.default_rng(chunk + sub)
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  q, k = unit(rng.normal(size=(2, chunk, 32)))
  v = rng.normal(size=(chunk, 16))
  g = rng.uniform(-5 if bounded else -40, 0, size=(chunk, 32))
  beta = rng.uniform(size=(chunk, 1))
  doc = np.repeat(np.arange(len(docs)), docs).astype(np.int32)
  masks = (jnp.asarray(doc[:, None]), jnp.asarray(doc[None, :]),
           jnp.asarray(doc == 0, jnp.float32)[:, None],
           jnp.asarray(doc == doc[-1], jnp.float32)[:, None])
  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
  kw = dict(scale=0.3, sub=sub, mm_dtype=jnp.float32, precision=lax.Precision.HIGHEST,
            bounded=bounded)
  outs, vjp = jax.vjp(lambda *a: tile.chunk_prep(*a, *masks, **kw), *args)
  cots = [jnp.asarray(rng.normal(size=o.shape), jnp.float32) for o in outs]
  hand_outs, hand_vjp = tile.chunk_prep_vjp(*args, *masks, **kw)
  for a, b in zip(hand_outs, outs):
    np.testing.assert_array_equal(a, b)
  for name, a, b in zip(("q", "k", "v", "g", "beta"), hand_vjp(*cots), vjp(tuple(cots))):
    assert rel_rms(a, b) < 1e-6, name
  # the backward from prep's saved inverse and scores is the recomputing one
  *with_outs, inv, s_kk = tile.chunk_prep(*args, *masks, with_inverse=True, **kw)
  _, saved_vjp = tile.chunk_prep_vjp(*args, *masks, inverse=(inv, s_kk), **kw)
  for a, b in zip((*with_outs, *saved_vjp(*cots)), (*outs, *hand_vjp(*cots))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("chunk,sub", [(16, 16), (32, 8)])
def test_saved_inverse_backward_is_the_recomputing_one(chunk, sub):
  """`save_inverse` (the default): prep writes (I + A_kk)^-1 and s_kk, and chunk_bwd reads
  them instead of recomputing the inverse's chain of products. Packed documents, T = 100
  padded, K != V: outputs and every gradient as the recomputing kernels give them, and
  within RTOL_FP32 of the literal recurrence."""
  q, k, v, g, beta, h0 = make_inputs(15, 2, 100, 2, 32, 16)
  seg = packed_segment_ids()
  cot = cotangents(16, v.shape, h0.shape)
  fn = functools.partial(interpret, chunk_size=chunk, sub_chunk_size=sub, segment_ids=seg)
  out, grads = forward_and_grads(functools.partial(fn, save_inverse=False),
                                 q, k, v, g, beta, h0, *cot)
  out_saved, grads_saved = forward_and_grads(fn, q, k, v, g, beta, h0, *cot)
  for a, b in zip((*out_saved, *grads_saved), (*out, *grads)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(np.max(np.abs(b))))
  naive = functools.partial(kda_naive, segment_ids=seg)
  check(out_saved, grads_saved, *forward_and_grads(naive, q, k, v, g, beta, h0, *cot),
        RTOL_FP32, 2)


def test_prep_keeps_the_inverse_only_for_a_backward():
  """A plain forward's prep writes the recurrence's six operands; under autodiff it writes
  chunk_bwd's inverse and scores too (`save_inverse`), unless told not to, or unless the
  backward runs prep again (`save_states=False`)."""
  x = jnp.ones((1, 32, 1, 16), jnp.bfloat16)
  beta = jnp.ones((1, 32, 1), jnp.bfloat16)

  def prep_outputs(fn, **kw):
    loss = lambda q: jnp.sum(kda_pallas(q, x, x, -jnp.ones_like(x), beta, platform="gpu",
                                        chunk_size=16, **kw).astype(jnp.float32))
    return [len(e.outvars) for e in jaxpr_eqns(jax.make_jaxpr(fn(loss))(x).jaxpr)
            if e.primitive.name == "pallas_call"
            and e.params["jaxpr"].debug_info.func_name == "_prep_kernel"]

  assert prep_outputs(lambda f: f) == [6]
  assert prep_outputs(jax.value_and_grad) == [8]
  assert prep_outputs(jax.value_and_grad, save_inverse=False) == [6]
  # states recomputed: the backward runs prep again, and only that one keeps the inverse
  assert sorted(prep_outputs(jax.value_and_grad, save_states=False)) == [6, 8]


def test_unbounded_gate_kernel_matches_naive():
  """Kimi Linear's softplus gate (down to -60 a token, as test_kda_ops' chunked spec) through
  the kernels with `bounded_gate=False`: outputs, final state and every gradient equal the
  literal recurrence, chunks of 32 in sub-tiles of 8 with packed documents and the GPU's
  16 / 16 without. The bounded form on the same gate does not (its factors overflow)."""
  B, T, H, K, V = 2, 100, 2, 32, 16
  q, k, v, _, beta, h0 = make_inputs(12, B, T, H, K, V)
  f = np.random.default_rng(13).standard_normal((B, T, H, K)) * 3
  f[1, 20:60] += 30.0
  g = jnp.asarray(-2.0 * np.logaddexp(0.0, f), jnp.float32)      # -A softplus(f), A = 2
  assert float(g.min()) < -60
  cot = cotangents(14, (B, T, H, V), (B, H, K, V))
  for chunk, sub, seg in ((32, 8, packed_segment_ids()), (16, 16, None)):
    naive = functools.partial(kda_naive, segment_ids=seg)
    kernel = functools.partial(interpret, chunk_size=chunk, sub_chunk_size=sub,
                               segment_ids=seg, bounded_gate=False)
    out_ref, grads_ref = forward_and_grads(naive, q, k, v, g, beta, h0, *cot)
    out, grads = forward_and_grads(kernel, q, k, v, g, beta, h0, *cot)
    check(out, grads, out_ref, grads_ref, RTOL_FP32, B)
  bounded = functools.partial(interpret, chunk_size=16, sub_chunk_size=16)
  o = np.asarray(compile_fast(bounded, q, k, v, g, beta)(q, k, v, g, beta))
  assert not np.all(np.isfinite(o[1])) or rel_rms(o[1], out_ref[0][1]) > RTOL_FP32


def test_kernel_unaligned_head_dims():
  """K = 20, V = 24 (padded inside to 32), one head, T = 40 (< one chunk), no initial
  state: output and final state vs naive, fp32."""
  q, k, v, g, beta, _ = make_inputs(12, 1, 40, 1, 20, 24)
  run = functools.partial(interpret, output_final_state=True, scale=0.3)
  o, s = compile_fast(run, q, k, v, g, beta)(q, k, v, g, beta)
  o_ref, s_ref = kda_naive(q, k, v, g, beta, output_final_state=True, scale=0.3)
  assert o.shape == (1, 40, 1, 24) and s.shape == (1, 1, 20, 24)
  assert rel_rms(o, o_ref) < RTOL_FP32 and rel_rms(s, s_ref) < RTOL_FP32


def test_dispatcher_backends():
  """"interpret" is kda_pallas in interpret mode; "auto" is "reference" on CPU and the kernel
  on GPU (Triton, chunk 16 unless named) and TPU (Mosaic, chunk 64); the error lists every
  backend."""
  q, k, v, g, beta, h0 = make_inputs(10, 1, 20, 1, 16, 16)
  trace = lambda f, **kw: str(jax.make_jaxpr(functools.partial(
      f, initial_state=h0, output_final_state=True, scale=0.3, **kw))(q, k, v, g, beta))
  assert trace(kda, backend="interpret") == trace(kda_pallas, interpret=True)
  assert trace(kda, backend="auto") == trace(kda_chunk)
  assert trace(kda, backend="auto", platform="gpu") == trace(kda_pallas, platform="gpu",
                                                              chunk_size=16)
  assert trace(kda, backend="auto", platform="gpu", chunk_size=32) == trace(
      kda_pallas, platform="gpu", chunk_size=32)
  assert trace(kda, backend="auto", platform="tpu") == trace(kda_pallas, platform="tpu",
                                                              chunk_size=64)
  assert default_chunk_size("kernel", "gpu") == 16
  assert default_chunk_size("auto", "cpu") == default_chunk_size("kernel", "tpu") == 64
  with pytest.raises(ValueError, match="kernel.*interpret.*auto"):
    kda(q, k, v, g, beta, backend="triton")


def test_kernel_rejects_bad_tiles():
  q, k, v, g, beta, _ = make_inputs(11, 1, 20, 1, 16, 16)
  with pytest.raises(ValueError, match="power of two"):
    kda_pallas(q, k, v, g, beta, chunk_size=48, interpret=True)
  with pytest.raises(ValueError, match="gate bound"):
    kda_pallas(q, k, v, g, beta, sub_chunk_size=32, interpret=True)
  # Triton asks for 320 KiB of shared memory at 64 (the H200 has 227): refused up front,
  # naming the limit, instead of failing inside XLA's compile on the GPU
  with pytest.raises(ValueError, match="chunk_size=64: the GPU kernels run chunks of at most"):
    kda_pallas(q, k, v, g, beta, chunk_size=64, platform="gpu")


def test_recurrence_blocks_by_programs():
  """The recurrences' V blocks: the widest of 64 / 32 / 16 that gives 256 programs, and on
  GPU the forward saving states at blocks of 32 on 2 warps where those give 256 programs
  (H200: faster at (8, 4096, 16) and (2, 8192, 96)). Long sequences of few rows and heads
  run in spans (fastest on the H200: 8 at (1, 32768, 16), 4 at (2, 16384, 16); one at
  (2, 4096, 16) and (4, 8192, 16)), whose programs then count."""
  from pallas_kernels.kda.pallas import kernel_inputs  # noqa: PLC0415

  def blocks_of(B, T, H, platform, **tuning):
    found = []

    def inputs(x):  # traced abstractly: no arrays of the full shape are made
      cfg, args = kernel_inputs(x, x, x, x, x[..., 0], scale=None, initial_state=None,
                                segment_ids=None, chunk_size=16, sub_chunk_size=16,
                                interpret=False, platform=platform, block_v=None,
                                save_states=True, **tuning)
      found.append(cfg)
      return args

    jax.eval_shape(inputs, jax.ShapeDtypeStruct((B, T, H, 128), jnp.bfloat16))
    return found[0].spans, found[0].block_v, found[0].states_block_v, found[0].states_warps

  assert blocks_of(8, 4096, 16, "gpu") == (1, 64, 32, 2)
  assert blocks_of(2, 8192, 96, "gpu") == (1, 64, 32, 2)
  assert blocks_of(4, 8192, 16, "gpu") == (1, 32, 32, 2)
  assert blocks_of(2, 4096, 16, "gpu") == (1, 16, 0, 0)
  assert blocks_of(2, 16384, 16, "gpu") == (4, 64, 32, 2)
  assert blocks_of(1, 32768, 16, "gpu") == (8, 64, 32, 2)
  assert blocks_of(1, 32768, 16, "gpu", spans=1) == (1, 16, 0, 0)
  assert blocks_of(8, 4096, 16, "tpu") == (1, 64, 0, 0)
  assert blocks_of(1, 32768, 16, "tpu") == (1, 16, 0, 0)
  with pytest.raises(ValueError, match="spans=2 must be a power of two .1 on TPU"):
    blocks_of(1, 256, 16, "tpu", spans=2)
  with pytest.raises(ValueError, match="spans=3 must be a power of two"):
    blocks_of(1, 256, 16, "gpu", spans=3)


def test_lowers_for_cuda():
  """Forward and backward lower to Triton for CUDA (no GPU needed): bf16, K = V = 128,
  packed documents and an initial state; the unbounded gate's kernels too."""
  B, T, H, D = 1, 200, 2, 128
  sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = (sd(B, T, H, D), sd(B, T, H, D), sd(B, T, H, D), sd(B, T, H, D), sd(B, T, H),
          sd(B, H, D, D, dt=jnp.float32), sd(B, T, dt=jnp.int32))

  def lowered(save_states, n_spans=1, bounded_gate=True, layers=1, save_inverse=True):
    def loss(q, k, v, g, beta, h0, seg):
      total = 0.0
      for i in range(layers):   # each distinct call's kernels are lowered once
        o, s = kda_pallas(q * (i + 1), k, v, g, beta, initial_state=h0, segment_ids=seg,
                          output_final_state=True, platform="gpu", save_states=save_states,
                          spans=n_spans, bounded_gate=bounded_gate,
                          save_inverse=save_inverse)
        total += jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
      return total

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    return jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  # prep, rec_fwd (states saved), rec_bwd, chunk_cots, chunk_bwd; recomputing adds prep and
  # rec_fwd (the value keeps the forward's own: a gradient alone drops them)
  assert lowered(True).count("__gpu$xla.gpu.triton") == 5
  assert lowered(True, layers=3).count("__gpu$xla.gpu.triton") == 5
  assert lowered(True, bounded_gate=False).count("__gpu$xla.gpu.triton") == 5
  assert lowered(False).count("__gpu$xla.gpu.triton") == 7
  assert lowered(True, save_inverse=False).count("__gpu$xla.gpu.triton") == 5
  assert lowered(False, save_inverse=False).count("__gpu$xla.gpu.triton") == 7
  # in spans the forward adds the transitions and the chain, the backward the spans' own
  # cotangents and the chain back
  assert lowered(True, n_spans=2).count("__gpu$xla.gpu.triton") == 9


def _kernel_precisions(**kw):
  """{kernel name: the precisions of its fp32 matmuls} in the GPU gradient of kda_pallas."""
  import re  # noqa: PLC0415
  x = jnp.ones((1, 32, 1, 16), jnp.bfloat16)
  beta = jnp.ones((1, 32, 1), jnp.bfloat16)
  loss = lambda q: jnp.sum(kda_pallas(q, x, x, -jnp.ones_like(x), beta, platform="gpu",
                                      chunk_size=16, **kw).astype(jnp.float32))
  return {e.params["jaxpr"].debug_info.func_name:
          set(re.findall(r"precision=(\w+)", str(e.params["jaxpr"])))
          for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(x).jaxpr)
          if e.primitive.name == "pallas_call"}


def test_backward_precision_is_its_own():
  """On GPU, `bwd_precision` sets the chunk backward's fp32 matmuls and leaves the prep
  kernel's (`prep_precision`) as they are; both are 1-pass TF32 by default."""
  default, x3_bwd = _kernel_precisions(), _kernel_precisions(bwd_precision="tf32x3")
  x3, one_pass = {"TF32_TF32_F32_X3"}, {"TF32_TF32_F32"}
  assert default["_prep_kernel"] == default["_chunk_bwd_kernel"] == one_pass
  assert x3_bwd["_prep_kernel"] == one_pass and x3_bwd["_chunk_bwd_kernel"] == x3


def test_gpu_kernels_take_the_callers_layout():
  """On GPU (and in interpret mode) the kernels read q, k, v, g, beta as the caller's
  [B, T, H, D] and write o and the gradients so, in the inputs' dtypes: forward and backward
  hold no transpose or cast of a per-token array (on the H200 at (8, 4096, 16, 128) the
  transposes took 0.47 of 1.81 ms forward). On TPU the kernels' heads-major layout costs
  transposes."""
  B, T, H, D = 1, 32, 2, 16
  x = jnp.ones((B, T, H, D), jnp.bfloat16)
  beta = jnp.ones((B, T, H), jnp.bfloat16)

  def passes_over_tokens(platform):
    def fwd_bwd(q, k, v, g, beta):
      o, vjp = jax.vjp(functools.partial(kda_pallas, platform=platform, chunk_size=16),
                       q, k, v, g, beta)
      return o, vjp(o)

    eqns = jaxpr_eqns(jax.make_jaxpr(fwd_bwd)(x, x, x, -x, beta).jaxpr)
    per_token = lambda e: any(len(v.aval.shape) == 4 and T in v.aval.shape for v in e.invars)
    return [e.primitive.name for e in eqns if per_token(e)
            and e.primitive.name in ("transpose", "convert_element_type")]

  assert passes_over_tokens("gpu") == []
  assert "transpose" in passes_over_tokens("tpu")


def test_tpu_form_matches_naive():
  """The TPU form of the recurrence (chunks on a sequential grid axis, the state in VMEM
  scratch), in interpret mode: packed documents, an initial state, T = 70; outputs, final
  state and every gradient vs naive, fp32."""
  q, k, v, g, beta, h0 = make_inputs(13, 1, 70, 2, 32, 16)
  seg = jnp.asarray(np.repeat([[4, 4, 7]], [30, 20, 20], axis=1), jnp.int32)  # [1, 70]
  cot = cotangents(14, v.shape, h0.shape)
  naive = functools.partial(kda_naive, segment_ids=seg)
  tpu = functools.partial(interpret, platform="tpu", segment_ids=seg, chunk_size=32)
  out_ref, grads_ref = forward_and_grads(naive, q, k, v, g, beta, h0, *cot)
  out, grads = forward_and_grads(tpu, q, k, v, g, beta, h0, *cot)
  check(out, grads, out_ref, grads_ref, RTOL_FP32, 1)


def test_tpu_aot_compile():
  """Forward and backward compile for a TPU v5p 2x2x1 slice through libtpu (Mosaic), under
  shard_map with batch on one mesh axis and heads on the other: five Mosaic kernels in
  the gradient (prep, recurrence forward with saved states, recurrence backward, chunk_cots,
  chunk_bwd), seven with save_states=False (prep and the recurrence again in the
  backward); the unbounded gate's five (its diagonal tiles a column at a time, 64 of 16)."""
  import os  # noqa: PLC0415
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest -n 2: two workers
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from tpu_aot import tpu_mesh  # noqa: PLC0415

  from pallas_kernels.kda.pallas import kda_pallas_sharded  # noqa: PLC0415
  mesh = tpu_mesh(("data", "model"), (2, 2))
  B, T, H, D = 2, 160, 2, 128
  spec = lambda s, p, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(
      mesh, p))
  tok = P("data", None, "model")
  args = (*[spec((B, T, H, D), tok)] * 4, spec((B, T, H), tok),
          spec((B, H, D, D), P("data", "model"), jnp.float32), spec((B, T), P("data"),
                                                                     jnp.int32))

  def compiled(save_states, bounded_gate=True):
    def loss(q, k, v, g, beta, h0, seg):
      o, s = kda_pallas_sharded(q, k, v, g, beta, initial_state=h0, segment_ids=seg,
                                output_final_state=True, platform="tpu", mesh=mesh,
                                batch_axis="data", head_axis="model",
                                save_states=save_states, bounded_gate=bounded_gate)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    return jax.jit(grad).trace(*args).lower().compile().as_text()

  assert compiled(True).count("tpu_custom_call") == 5
  assert compiled(False).count("tpu_custom_call") == 7
  assert compiled(True, bounded_gate=False).count("tpu_custom_call") == 5

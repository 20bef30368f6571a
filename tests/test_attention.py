"""pallas_kernels.attention: the flash backends (Pallas interpret mode on CPU) against the
dense reference -- outputs, every gradient and the QK-Clip max logit -- with packed
segments, padding, a shared key, Dqk != Dv and T off the block; what "auto" lowers to per
platform; the kernels under shard_map (CPU mesh, TPU AOT); causal attention with the
queries split along T (context parallelism) against the unsharded reference; the config
fields."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_eqns, random_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import config as k3config
from k3jax.model.mla import MLA
from pallas_kernels.attention import (attention, attention_reference, flash_gpu, flash_tpu,
                                      max_logit, max_logit_block, max_logit_gpu,
                                      run_slots, segment_runs, unique_padding_ids)

RTOL, ATOL = 1e-5, 2e-5   # fp32: kernel and reference differ only in summation order


def randn(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def packed_ids(b, t):
  """[b, t] ids: row 0 three documents with inner and trailing padding, row 1 one document
  then padding, row 2 (if any) all padding."""
  ids = np.zeros((b, t), np.int32)
  ids[0, :t // 4], ids[0, t // 4:t // 2], ids[0, t // 2 + 5:t - 9] = 1, 2, 7
  ids[1, :t - 30] = 3
  return jnp.asarray(ids)


def check_close(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def value_and_grads(fn, q, k, v, seed=9):
  """fn(q, k, v) -> out; returns out and d(sum(out * w))/d(q, k, v) for a fixed random w."""
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * randn(seed, *out.shape)), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_dense(causal):
  """MLA's shape (causal): one key shared by all heads, Dqk 192 vs Dv 128, T = 200 (the
  kernel pads to 256); the vision tower's (non-causal). Every row matches, padding ones
  too (each padding token sees only itself in both), and so do all gradients."""
  b, t, h, dqk, dv = 3, 200, 2, 192 if causal else 64, 128 if causal else 64
  q, k, v = randn(1, b, t, h, dqk), randn(2, b, t, 1 if causal else h, dqk), randn(3, b, t, h, dv)
  ids, scale = packed_ids(b, t), dqk ** -0.5
  run = lambda backend: value_and_grads(  # noqa: E731
      lambda q, k, v: attention(q, k, v, ids, scale=scale, causal=causal, backend=backend),
      q, k, v)
  (out, grads), (ref, ref_grads) = run("kernel"), run("reference")
  assert out.shape == (b, t, h, dv) and grads[1].shape == k.shape
  check_close(out, ref)
  for g, r in zip(grads, ref_grads):
    check_close(g, r)
  assert np.abs(np.asarray(grads[1])).max() > 1e-2   # the shared key gets a gradient


def test_splash_several_blocks():
  """Splash itself with 128-blocks over T = 300 (3 q x 3 kv blocks, causal across them)."""
  b, t, h, d = 2, 300, 2, 64
  q, k, v = randn(4, b, t, h, d), randn(5, b, t, h, d), randn(6, b, t, h, d)
  ids = packed_ids(b, t)
  kernel = functools.partial(flash_tpu, scale=0.3, causal=True, interpret=True, block=128)
  out, grads = value_and_grads(
      lambda q, k, v: kernel(q, k, v, unique_padding_ids(ids), unique_padding_ids(ids)), q, k, v)
  ref, ref_grads = value_and_grads(
      lambda q, k, v: attention_reference(q, k, v, ids, scale=0.3, causal=True)[0], q, k, v)
  check_close(out, ref)
  for g, r in zip(grads, ref_grads):
    check_close(g, r)


def test_triton_kernel_interpreted():
  """The GPU path (Triton `mha` in interpret mode): v zero-padded to Dqk = 48 (the kernel
  pads 48 -> 64 inside), T = 100 off its block, padding ids, gradients with segment ids."""
  b, t, h, dqk, dv = 2, 100, 2, 48, 32
  q, k, v = randn(7, b, t, h, dqk), randn(8, b, t, h, dqk), randn(9, b, t, h, dv)
  ids = packed_ids(b, t)
  out, grads = value_and_grads(
      lambda q, k, v: flash_gpu(q, k, v, unique_padding_ids(ids), scale=0.3, causal=True,
                                interpret=True), q, k, v)
  ref, ref_grads = value_and_grads(
      lambda q, k, v: attention_reference(q, k, v, ids, scale=0.3, causal=True)[0], q, k, v)
  check_close(out, ref)
  for g, r in zip(grads, ref_grads):
    check_close(g, r)


@pytest.mark.parametrize("causal", [True, False])
def test_max_logit_equals_dense(causal):
  """Tile by tile (64-tiles over T = 200: diagonal, skipped and partial tiles) = the dense
  softmax's row maxima over real queries; an all-padding row adds nothing; no gradient.
  (The dispatcher's flash path returns it: test_model_reads_config_field.)"""
  b, t, h, d = 3, 200, 4, 24
  q, k = randn(10, b, t, h, d) * 3, randn(11, b, t, 1, d)
  ids = packed_ids(b, t)
  want = attention_reference(q, k, randn(12, b, t, h, 8), ids, scale=0.5, causal=causal)[1]
  tiled = jax.jit(functools.partial(max_logit, scale=0.5, causal=causal, block=64))
  np.testing.assert_allclose(np.asarray(tiled(q, k, ids)), np.asarray(want), rtol=1e-6)
  assert np.all(np.asarray(tiled(q, k, jnp.zeros_like(ids))) == -np.inf)
  g = jax.jit(jax.grad(lambda q: jnp.sum(tiled(q, k, ids))))(q)
  assert not np.asarray(g).any()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_max_logit_kernel_equals_dense(causal, shared):
  """The Triton kernel (interpreted) = the dense row maxima: Dqk 48 as pieces of 32 and 16,
  T = 200 over query blocks of 32 and key blocks of 16 (diagonal, skipped, padded blocks),
  one key for all heads or one each; an all-padding batch gives -inf; no gradient."""
  b, t, h, d = 3, 200, 4, 48
  q, k = randn(20, b, t, h, d) * 3, randn(21, b, t, 1 if shared else h, d)
  ids = packed_ids(b, t)
  want = attention_reference(q, k, randn(22, b, t, h, 8), ids, scale=0.5, causal=causal)[1]
  kernel = jax.jit(functools.partial(max_logit_gpu, scale=0.5, causal=causal, block_q=32,
                                     block_k=16, interpret=True))
  np.testing.assert_allclose(np.asarray(kernel(q, k, ids)), np.asarray(want), rtol=1e-6)
  assert np.all(np.asarray(kernel(q, k, jnp.zeros_like(ids))) == -np.inf)
  g = jax.jit(jax.grad(lambda q: jnp.sum(kernel(q, k, ids))))(q)
  assert not np.asarray(g).any()


def test_segment_runs_are_cudnn_packed_rows():
  """Each row's documents as cuDNN's packed layout lists them: run starts (then -1),
  lengths (then -1) and the run count, which may exceed the slots (the dispatcher then
  takes the Triton kernel); padding (0) is in no run, and an id change starts a run."""
  ids = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 3, 3, 0],
                     [0, 0, 5, 5, 5, 5, 5, 5, 5, 5],
                     [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]])
  offsets, lengths, runs = segment_runs(ids, 4)
  np.testing.assert_array_equal(offsets, [[0, 2, 7, -1, -1], [2, -1, -1, -1, -1],
                                          [0, 1, 2, 3, -1]])
  np.testing.assert_array_equal(lengths, [[2, 3, 2, -1], [8, -1, -1, -1], [1, 1, 1, 1]])
  np.testing.assert_array_equal(runs, [3, 1, 9])
  # cuDNN's fp32 dq accumulator per run slot is B T H Dqk 4 bytes: slots within the budget
  assert run_slots(2, 4096, 16, 192) == 42 and run_slots(1, 131_072, 16, 192) == 2
  assert run_slots(1, 256, 1, 16) == 64


def test_max_logit_tiles_grow_for_long_rows_of_few_heads():
  """The tile side doubles from 512 while one fp32 tile stays within the byte budget and
  below T: a 131,072-token row of 16 heads is not 8,000 tiny tiles a layer."""
  assert max_logit_block(1, 16, 131_072) == 2048          # 16 x 2048^2 x 4 B = 256 MiB
  assert max_logit_block(1, 96, 1_048_576) == 512         # 96 heads: 512 already fits
  assert max_logit_block(1, 1, 600) == 512                # never below 512, never past T
  assert max_logit_block(2, 4, 100_000) == 2048


def _loss_fn(backend, causal=True, **kw):
  def loss(q, k, v, ids):
    out = attention(q, k, v, ids, scale=0.1, causal=causal, backend=backend, **kw)
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


SPECS = (jax.ShapeDtypeStruct((2, 256, 4, 192), jnp.bfloat16),
         jax.ShapeDtypeStruct((2, 256, 1, 192), jnp.bfloat16),
         jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16),
         jax.ShapeDtypeStruct((2, 256), jnp.int32))


def test_a_named_platform_traces_its_kernels_only():
  """With the platform known (`platform=`, or the mesh's devices) only its kernels are
  traced: no choice left to lowering, no splash (its mask tables cost (T / block)^2 to
  build while tracing) in a GPU program, no Triton in a TPU one. With none named on a CPU host, each
  platform's kernels are traced and lowering picks."""
  from conftest import jaxpr_eqns  # noqa: PLC0415

  def traced(platform):
    jaxpr = jax.make_jaxpr(lambda q, k, v, ids: attention(
        q, k, v, ids, scale=0.1, causal=True, backend="auto", platform=platform))(*SPECS).jaxpr
    kinds = {"platform_index"}.intersection(e.primitive.name for e in jaxpr_eqns(jaxpr))
    for e in jaxpr_eqns(jaxpr):
      if e.primitive.name == "pallas_call":
        module = type(e.params["compiler_params"]).__module__
        kinds |= {k for k in ("mosaic.", "triton.") if f"pallas.{k}" in module}
    return kinds
  assert traced(None) == {"platform_index", "mosaic.", "triton."}
  assert traced("gpu") == {"triton."}
  assert traced("tpu") == {"mosaic."}


@pytest.mark.parametrize("backend", ["auto", "kernel", "reference"])
def test_auto_lowering_per_platform(backend):
  """"auto" is decided when lowering: splash's Mosaic call for TPU, the GPU kernels for
  CUDA (Triton here: cuDNN is looked for when tracing, and a CPU host has none), no kernel
  on CPU (where it is the dense reference, exactly); "reference" never a kernel."""
  traced = jax.jit(_loss_fn(backend)).trace(*SPECS)
  tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert ("tpu_custom_call" in tpu) == (backend != "reference")
  assert ("__gpu$xla.gpu.triton" in cuda) == (backend != "reference")
  if backend != "kernel":  # (the forced kernel interprets splash on CPU)
    assert "tpu_custom_call" not in cpu and "triton" not in cpu
  if backend == "auto":
    q, k, v = randn(13, 2, 40, 3, 16), randn(14, 2, 40, 1, 16), randn(15, 2, 40, 3, 8)
    ids = packed_ids(2, 40)
    fn = lambda be: jax.jit(lambda *a: attention(*a, ids, scale=0.1, causal=True,  # noqa: E731
                                                 backend=be, return_max_logit=True))(q, k, v)
    for got, want in zip(fn("auto"), fn("reference")):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sharded_on_cpu_mesh():
  """Under shard_map on the 8 simulated CPU devices (interpret mode): MLA's layout (batch
  over data, heads over tensor) and the vision tower's (query rows over data, vmapped over
  buffers) give the dense result."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  b, t, h, d = 2, 64, 2, 16
  q, k, v = randn(16, b, t, h, d), randn(17, b, t, h, d), randn(18, b, t, h, d)
  ids = jnp.asarray(np.r_[np.ones(40), np.zeros(24)].astype(np.int32)[None].repeat(2, 0))
  run = lambda be, **kw: jax.jit(lambda q, k, v: attention(  # noqa: E731
      q, k, v, ids, scale=0.2, backend=be, **kw))(q, k, v)
  check_close(run("kernel", causal=True, mesh=mesh, batch_axis="data", head_axis="tensor"),
              run("reference", causal=True))

  def vision(q, k, v, ids):   # one buffer [N, H, D], as in VisionBlock
    return attention(q[None], k[None], v[None], ids[None], scale=0.2, causal=False,
                     backend="kernel", mesh=mesh, seq_axis="data", head_axis="tensor")[0]
  got = jax.jit(jax.vmap(vision))(q, k, v, ids)
  check_close(got, run("reference", causal=False))


CP_IDS = np.array([[1] * 21 + [2] * 11 + [5] * 18 + [0] * 3 + [6] * 11,  # 5 starts at T/2
                   [0] * 16 + [3] * 40 + [0] * 8,       # starts at a slice boundary (c 4, 8)
                   [0] * 64,                            # all padding
                   [4] * 64], np.int32)                 # one document across every slice
# c: (mesh shape over ("data", "context", "tensor"), batch_axis, seq_axis)
CP_LAYOUTS = [(2, (2, 2, 2), "data", "context"), (4, (1, 4, 2), "data", "context"),
              (4, (2, 2, 2), None, ("data", "context")), (8, (1, 8, 1), "data", "context")]


@functools.cache
def cp_inputs(key_heads, heads=2):
  """q [4, 64, heads, 16], k [4, 64, key_heads, 16], v [4, 64, heads, 8] and the weights of
  the summed output; ids CP_IDS."""
  b, t, h = CP_IDS.shape + (heads,)
  return (randn(20, b, t, h, 16), randn(21, b, t, key_heads, 16), randn(22, b, t, h, 8),
          randn(23, b, t, h, 8))


def cp_run(backend, q, k, v, w, **kw):
  """Output, max logit and d(sum(out * w))/d(q, k, v) of causal attention over CP_IDS."""
  def loss(q, k, v):
    out, logit = attention(q, k, v, jnp.asarray(CP_IDS), scale=0.3, causal=True,
                           backend=backend, return_max_logit=True, **kw)
    return jnp.sum(out * w), (out, logit)
  (_, (out, logit)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, logit, grads


def check_cp_equals_dense(backend, q, k, v, w, **where):
  """`backend` placed as `where` says gives the unsharded dense reference's output, max
  logit and gradients."""
  out, logit, grads = cp_run(backend, q, k, v, w, **where)
  ref, ref_logit, ref_grads = cp_run("reference", q, k, v, w)
  check_close(out, ref)
  np.testing.assert_allclose(np.asarray(logit), np.asarray(ref_logit), rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    check_close(g, r)


@pytest.mark.parametrize("c, shape, seq_axis, head_axis", [
    (4, (2, 4, 1), "context", None), (2, (2, 2, 2), "context", "tensor"),
    (4, (2, 2, 2), ("data", "context"), "tensor")])
def test_splash_exchanges_heads_where_they_divide(c, shape, seq_axis, head_axis):
  """Splash (interpreted) with T split into c slices and 8 heads, which split into c on each
  device: all-to-alls give every device all T of a c-th of its heads; output, max logit
  and every gradient equal the unsharded reference."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(shape), ("data", "context", "tensor"))
  q, k, v, w = cp_inputs(1, 8)
  where = dict(mesh=mesh, batch_axis=None if "data" in seq_axis else "data",
               head_axis=head_axis, seq_axis=seq_axis)
  check_cp_equals_dense("kernel", q, k, v, w, **where)
  jaxpr = jax.make_jaxpr(lambda q, k, v: attention(
      q, k, v, jnp.asarray(CP_IDS), scale=0.3, causal=True, backend="kernel", **where))
  assert "all_to_all" in {e.primitive.name for e in jaxpr_eqns(jaxpr(q, k, v).jaxpr)}


@pytest.mark.parametrize("backend", ["reference", "kernel"])
@pytest.mark.parametrize("c, shape, batch_axis, seq_axis", CP_LAYOUTS)
def test_context_parallel_matches_dense(backend, c, shape, batch_axis, seq_axis):
  """Causal attention with the queries split into c slices along T (seq_axis: one mesh axis,
  or a tuple whose linear index orders the slices), heads over tensor, rows over
  batch_axis: documents crossing slice boundaries or starting on one, padding, an
  all-padding row. Output, max logit and every gradient equal the unsharded reference."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(shape), ("data", "context", "tensor"))
  q, k, v, w = cp_inputs(1 if isinstance(seq_axis, str) else 2)
  check_cp_equals_dense(backend, q, k, v, w, mesh=mesh, batch_axis=batch_axis,
                        head_axis="tensor", seq_axis=seq_axis)


# heads, shared keys and values, mesh shape over names, head axis, seq axis, all_to_all
GPU_CP = [(2, False, (2, 4), ("data", "context"), None, "context", False),
          (2, True, (2, 2, 2), ("data", "context", "tensor"), "tensor", "context", False),
          (8, False, (2, 4), ("data", "context"), None, "context", True),
          (8, True, (2, 2, 2), ("data", "context", "tensor"), "tensor", "context", True),
          (8, False, (2, 2, 2), ("data", "context", "tensor"), "tensor", ("data", "context"),
           True)]


@pytest.mark.parametrize("heads, shared_kv, shape, names, head_axis, seq_axis, exchanged",
                         GPU_CP)
def test_context_parallel_gpu(monkeypatch, heads, shared_kv, shape, names, head_axis,
                              seq_axis, exchanged):
  """The GPU path with T split over seq_axis (c = 2, 4), run as lowered for CUDA with Triton
  interpreted: where each device's heads split into the c slices, an all-to-all gives every
  device all T of a c-th of its heads (keys and values shared by all heads, MLA absorbed,
  gathered); else each device computes all T of all its heads. Output, max logit and every
  gradient equal the reference, with documents crossing slice boundaries."""
  import pallas_kernels.attention as attention_ops  # noqa: PLC0415
  monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, **_: cuda(*args))
  monkeypatch.setattr(attention_ops, "flash_gpu", functools.partial(flash_gpu, interpret=True))
  monkeypatch.setattr(attention_ops, "max_logit_gpu",
                      functools.partial(max_logit_gpu, interpret=True))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(shape), names)
  q, k, v, w = cp_inputs(1, heads)
  if shared_kv:
    v = v[:, :, :1]
  where = dict(mesh=mesh, batch_axis=None if "data" in seq_axis else "data",
               seq_axis=seq_axis, head_axis=head_axis)
  got = cp_run("kernel", q, k, v, w, **where)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(cp_run("reference", q, k, v, w))):
    check_close(g, r)
  jaxpr = jax.make_jaxpr(lambda q, k, v: attention(
      q, k, v, jnp.asarray(CP_IDS), scale=0.3, causal=True, backend="kernel", **where))
  prims = {e.primitive.name for e in jaxpr_eqns(jaxpr(q, k, v).jaxpr)}
  assert ("all_to_all" in prims) == exchanged


def test_context_parallel_dense_scores_per_slice():
  """Dense with seq_axis (c = 4): forward and backward hold [B, H, T/c, T] scores per device
  (under shard_map), never [B, H, T, T]."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("context",))
  q, k, v, w = cp_inputs(1)
  t = q.shape[1]

  def loss(q, k, v):
    out = attention(q, k, v, jnp.asarray(CP_IDS), scale=0.3, causal=True, backend="reference",
                    mesh=mesh, seq_axis="context")
    return jnp.sum(out * w)
  shapes = {tuple(o.aval.shape[-2:]) for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(
      loss, (0, 1, 2)))(q, k, v).jaxpr) for o in e.outvars if o.aval.ndim == 4}
  assert (t // 4, t) in shapes and (t, t) not in shapes


@pytest.mark.parametrize("h, exchanged", [(4, True), (2, False)])
def test_tpu_aot_context_parallel_flash_fits(h, exchanged):
  """The flash path's gradient (with the max logit) with T split over context (c = 2) and
  heads over tensor, compiled for a v5p 2x2x1: splash's Mosaic kernels on all T of a half
  of each device's heads (h = 4: two a device, exchanged by all-to-alls) or on each
  device's query rows (h = 2: one a device); temporaries far below one [B, H, T/c, T] fp32
  score tensor per device (what dense would hold)."""
  from tpu_aot import tpu_mesh  # noqa: PLC0415
  mesh = tpu_mesh(("context", "tensor"), (2, 2))
  b, t = 2, 4096
  shard = lambda shape, spec, dt=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dt, sharding=NamedSharding(mesh, spec))
  args = (shard((b, t, h, 192), P(None, "context", "tensor")), shard((b, t, 1, 192), P()),
          shard((b, t, h, 128), P(None, "context", "tensor")), shard((b, t), P(), jnp.int32))

  def loss(q, k, v, ids):
    out, logit = attention(q, k, v, ids, scale=0.1, causal=True, return_max_logit=True,
                           mesh=mesh, head_axis="tensor", seq_axis="context")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(logit)
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
  text = lowered.as_text()
  assert "tpu_custom_call" in text and ("all_to_all" in text) == exchanged
  stats = lowered.compile().memory_analysis()
  scores = b * (h // 2) * (t // 2) * t * 4
  assert 0 < stats.temp_size_in_bytes < scores / 4


def test_tpu_aot_sharded_flash_fits():
  """The flash path's gradient compiled for a v5p 2x2x1 under shard_map (batch over data,
  heads over tensor): libtpu compiles splash's Mosaic kernels, and the temporaries stay far
  below one [B, H, T, T] fp32 score tensor per device (what dense would hold)."""
  from tpu_aot import tpu_mesh  # noqa: PLC0415
  mesh = tpu_mesh(("data", "tensor"), (2, 2))
  b, t, h = 2, 2048, 4
  shard = lambda shape, spec, dt=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dt, sharding=NamedSharding(mesh, spec))
  args = (shard((b, t, h, 192), P("data", None, "tensor")), shard((b, t, 1, 192), P("data")),
          shard((b, t, h, 128), P("data", None, "tensor")), shard((b, t), P("data"), jnp.int32))
  grad = _loss_fn("auto", mesh=mesh, batch_axis="data", head_axis="tensor",
                  return_max_logit=False)
  lowered = jax.jit(grad).lower(*args)
  assert "tpu_custom_call" in lowered.as_text()
  stats = lowered.compile().memory_analysis()
  scores = (b // 2) * (h // 2) * t * t * 4
  assert 0 < stats.temp_size_in_bytes < scores / 4


def test_model_reads_config_field():
  """model.mla.attention picks the backend: a small MLA gives the same output and max
  logit through "kernel" (interpret) as through "reference"."""
  from test_mla import SEG, inputs, small_model_cfg  # noqa: PLC0415
  outs = []
  for backend in ("kernel", "reference"):
    cfg = small_model_cfg()
    cfg.mla.attention = backend
    mla = random_model(cfg, model_cls=MLA)
    assert mla.backend == backend
    from flax import nnx  # noqa: PLC0415
    y, aux = nnx.jit(lambda m, x, s: m(x, s))(mla, inputs(), jnp.asarray(SEG))
    outs.append((y, aux["logit_max"]))
  check_close(outs[0][0], outs[1][0])
  np.testing.assert_allclose(np.asarray(outs[0][1]), np.asarray(outs[1][1]), rtol=1e-6)


@pytest.mark.parametrize("field", ["mla", "vision"])
def test_config_rejects_unknown_backend(field):
  cfg = k3config.base_config()
  cfg.model[field].attention = "splash"
  with pytest.raises(k3config.ConfigError, match=f"model.{field}.attention"):
    k3config.validate(cfg)


@pytest.mark.parametrize("field", ["mla", "vision"])
@pytest.mark.parametrize("old,new", [("dense", "reference"), ("flash", "kernel")])
def test_old_backend_names_are_told_the_new_ones(field, old, new):
  """A config, or a call, with a backend's old name fails naming the new one."""
  cfg = k3config.base_config()
  cfg.model[field].attention = old
  with pytest.raises(k3config.ConfigError,
                     match=f"model.{field}.attention: '{old}' was renamed '{new}'"):
    k3config.validate(cfg)
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=f"'{old}' was renamed '{new}'.*'reference', 'kernel'"):
    attention(q, q, q, jnp.ones((1, 8), jnp.int32), scale=1.0, causal=True, backend=old)


def test_tpu_aot_vision_layout():
  """The vision tower's layout compiled for TPU: per buffer (vmapped over rows) the query
  patches split over data, all keys and values of the buffer on every device, non-causal."""
  from tpu_aot import tpu_mesh  # noqa: PLC0415
  mesh = tpu_mesh(("data", "tensor"), (2, 2))
  rows, n, h, d = 2, 1024, 4, 128
  tok = jax.ShapeDtypeStruct((rows, n, h, d), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "data", "tensor")))
  ids = jax.ShapeDtypeStruct((rows, n), jnp.int32, sharding=NamedSharding(mesh, P(None, "data")))

  def loss(q, k, v, ids):
    def one(q, k, v, ids):
      return attention(q[None], k[None], v[None], ids[None], scale=0.1, causal=False,
                       mesh=mesh, seq_axis="data", head_axis="tensor")[0]
    return jnp.sum(jax.vmap(one)(q, k, v, ids).astype(jnp.float32))

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(tok, tok, tok, ids)
  assert "tpu_custom_call" in lowered.as_text()
  assert lowered.compile().memory_analysis().temp_size_in_bytes < rows * (h // 2) * n * n * 4


@pytest.mark.parametrize("c, shape, batch_axis, seq_axis", [(1, (1, 1, 1), None, None),
                                                           CP_LAYOUTS[2]])
def test_multi_query_flash_matches_dense(c, shape, batch_axis, seq_axis):
  """Keys and values both shared by all heads (MLA's absorbed form: Dqk = kv_lora + rope,
  Dv = kv_lora): splash's multi-query kernel on one device and with the queries split over
  context, output, max logit and gradients equal the dense reference."""
  b, t, h = CP_IDS.shape + (2,)
  q, k, v, w = (randn(30, b, t, h, 40), randn(31, b, t, 1, 40), randn(32, b, t, 1, 24),
                randn(33, b, t, h, 24))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:math.prod(shape)]).reshape(shape),
                           ("data", "context", "tensor"))
  check_cp_equals_dense("kernel", q, k, v, w, mesh=mesh, batch_axis=batch_axis,
                        head_axis="tensor", seq_axis=seq_axis)

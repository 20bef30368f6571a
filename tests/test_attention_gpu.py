"""The GPU attention kernels compiled for the GPU they run on (skipped elsewhere): cuDNN's
flash attention and the Triton max-logit kernel against the dense reference, and
`flash_cuda`'s choice between cuDNN's forms and Triton. bf16 inputs; the reference takes
the same bf16 values in fp32, so outputs and gradients differ by bf16 rounding (relative
RMS). conftest.py selects the CPU unless told otherwise:

  JAX_PLATFORMS=cuda python -m pytest tests/test_attention_gpu.py
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel
from pallas_kernels import backends
from pallas_kernels.attention import (attention_reference, cudnn_ready, flash_cuda, flash_cudnn,
                                      flash_gpu, max_logit_gpu, unique_padding_ids)

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
needs_cudnn = pytest.mark.skipif(not cudnn_ready(), reason="needs cuDNN on a Hopper GPU")

B, T, H, DQK, DV = 3, 1000, 4, 192, 128
BF16_RMS = 1e-2    # bf16 has 8 significant bits: 2^-8 = 3.9e-3 per rounding


def bf16(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


def documents(runs):
  """[B, T] ids: row 0 `runs` documents of equal length then 37 padding tokens; row 1 one
  document after 5 padding tokens; row 2 all padding."""
  ids = np.zeros((B, T), np.int32)
  ids[0, :T - 37] = 1 + np.arange(T - 37) * runs // (T - 37)
  ids[1, 5:] = 9
  return jnp.asarray(ids)


def single_documents():
  """[B, T] ids of cuDNN's unpacked form: row 0 one document then 37 padding tokens, row 1
  one document throughout, row 2 all padding."""
  ids = np.zeros((B, T), np.int32)
  ids[0, :T - 37], ids[1] = 4, 2
  return jnp.asarray(ids)


def value_and_grads(fn, q, k, v):
  w = bf16(9, B, T, H, DV).astype(jnp.float32)
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def inputs():
  return bf16(1, B, T, H, DQK), bf16(2, B, T, H, DQK), bf16(3, B, T, H, DV)


def reference(ids):
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return lambda q, k, v: attention_reference(f32(q), f32(k), f32(v), ids, scale=DQK ** -0.5,
                                             causal=True)[0]


@needs_cudnn
@pytest.mark.parametrize("runs, slots", [(1, 4), (3, 4), ("single", 1)])
def test_cudnn_matches_dense(runs, slots):
  """The packed form (one or three documents a row, padding before and after, a row of
  padding) and the unpacked one (a document from each row's first token): every output
  and gradient within bf16 rounding of the reference; a padding token's output is its
  value."""
  q, k, v = inputs()
  ids = single_documents() if runs == "single" else documents(runs)
  out, grads = value_and_grads(functools.partial(
      flash_cudnn, segment_ids=ids, scale=DQK ** -0.5, causal=True, slots=slots), q, k, v)
  ref, ref_grads = value_and_grads(reference(ids), q, k, v)
  errors = {name: rel(x, r) for name, x, r in zip(("out", "dq", "dk", "dv"),
                                                       (out, *grads), (ref, *ref_grads))}
  assert all(e < BF16_RMS for e in errors.values()), errors
  pad = np.asarray(ids) == 0
  np.testing.assert_array_equal(np.asarray(out)[pad], np.asarray(v)[pad])


@needs_cudnn
def test_flash_cuda_picks_the_form_each_batch_takes():
  """A batch of rows that are one document from their first token runs on cuDNN's unpacked
  form, bit for bit; rows of at most `run_slots` documents on its packed form; a batch with
  a row of more (here 100 > 64 slots) on the Triton kernel, and still matches."""
  q, k, v = inputs()
  scale = DQK ** -0.5
  cuda = jax.jit(lambda q, k, v, ids: flash_cuda(q, k, v, unique_padding_ids(ids),
                                                 scale=scale, causal=True))
  few, many = documents(3), documents(100)
  cudnn = lambda slots: jax.jit(functools.partial(  # noqa: E731
      flash_cudnn, scale=scale, causal=True, slots=slots))
  triton = jax.jit(lambda q, k, v, ids: flash_gpu(q, k, v, unique_padding_ids(ids),
                                                  scale=scale, causal=True))
  single = single_documents()
  np.testing.assert_array_equal(cuda(q, k, v, single), cudnn(1)(q, k, v, segment_ids=single))
  np.testing.assert_array_equal(cuda(q, k, v, few), cudnn(64)(q, k, v, segment_ids=few))
  np.testing.assert_array_equal(cuda(q, k, v, many), triton(q, k, v, many))
  assert rel(cuda(q, k, v, many), reference(many)(q, k, v)) < BF16_RMS


@needs_cudnn
def test_deterministic_programs_take_triton_alone():
  """Inside `backends.deterministic()` the forward and backward hold no cuDNN call (its
  deterministic backward does not run in XLA), and
  they equal the Triton kernel's bit for bit; outside it cuDNN is among the branches."""
  q, k, v = inputs()
  ids = unique_padding_ids(single_documents())

  def loss(q, k, v):
    out = flash_cuda(q, k, v, ids, scale=DQK ** -0.5, causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  # a jitted function keeps its first trace's kernels: one per setting, as programs do
  grad = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # noqa: E731
  with backends.deterministic():
    deterministic = grad()
    text = deterministic.trace(q, k, v).lower().as_text()
    got = deterministic(q, k, v)
  assert "cudnn" not in text and "__gpu$xla.gpu.triton" in text
  assert "cudnn" in grad().trace(q, k, v).lower().as_text()

  def triton_loss(q, k, v):
    out = flash_gpu(q, k, v, ids, scale=DQK ** -0.5, causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  want = jax.jit(jax.value_and_grad(triton_loss, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_cudnn
def test_kernels_remat_keeps_the_cudnn_forward():
  """remat "kernels" (`k3jax.model.remat`) around `flash_cuda`: the compiled gradient calls
  cuDNN's forward as often as without remat ("full" calls it more: it runs again for the
  backward), and its gradients are those without remat, within cuDNN's backward's run-to-run
  spread (a wrong residual would be O(1))."""
  from k3jax.model import remat  # noqa: PLC0415
  q, k, v = inputs()
  ids = unique_padding_ids(single_documents())

  def loss(q, k, v):
    out = flash_cuda(q, k, v, ids, scale=DQK ** -0.5, causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  def compiled(name):
    # value_and_grad keeps the primal forward live; under grad alone XLA drops it and even
    # "full" calls the forward once.
    grad = jax.value_and_grad(remat.wrap(loss, name), argnums=(0, 1, 2))
    return jax.jit(grad).lower(q, k, v).compile()

  def forwards(program):
    targets = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', program.as_text())
    return sum("Backward" not in t for t in targets)

  programs = {name: compiled(name) for name in ("none", "full", "kernels")}
  counts = {name: forwards(p) for name, p in programs.items()}
  assert counts["kernels"] == counts["none"] < counts["full"], counts
  (_, kept), (_, plain) = programs["kernels"](q, k, v), programs["none"](q, k, v)
  for a, b in zip(kept, plain):
    assert rel(a, b) < BF16_RMS


@pytest.mark.parametrize("shared", [True, False])
def test_max_logit_kernel_compiled(shared):
  """The Triton max-logit kernel compiled (128 x 64 blocks, Dqk 192 as 128 + 64) = the
  reference's max logit from the same bf16 values (fp32 sums in another order)."""
  q, k, _ = inputs()
  if shared:
    k = k[:, :, :1]
  ids = documents(3)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  want = attention_reference(f32(q), f32(k), jnp.zeros((B, T, H, 8)), ids, scale=DQK ** -0.5,
                             causal=True)[1]
  got = jax.jit(functools.partial(max_logit_gpu, scale=DQK ** -0.5, causal=True))(q, k, ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@needs_cudnn
def test_split_over_the_gpus_of_the_host():
  """The dispatcher with T split over every GPU here (context c = the device count; the
  heads exchanged by all-to-alls, cuDNN under shard_map): output and gradients within bf16
  rounding of the reference. T = 1000 is cut to a multiple of c."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from pallas_kernels.attention import attention  # noqa: PLC0415
  c = jax.device_count()
  mesh = Mesh(np.asarray(jax.devices()), ("context",))
  t = T // c * c
  q, k, v = (x[:, :t] for x in inputs())
  ids = documents(3)[:, :t]
  split = NamedSharding(mesh, P(None, "context"))
  placed = [jax.device_put(x, split) for x in (q, k, v)]
  fn = lambda q, k, v: attention(q, k, v, ids, scale=DQK ** -0.5, causal=True,  # noqa: E731
                                 backend="kernel", mesh=mesh, seq_axis="context")
  w = bf16(9, B, t, H, DV).astype(jnp.float32)
  def grads(fn, *args):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w),
                                      (0, 1, 2)))(*args)[1]
  got, want = grads(fn, *placed), grads(reference(ids), q, k, v)
  for name, x, r in zip(("dq", "dk", "dv"), got, want):
    assert rel(x, r) < BF16_RMS, name
  out = jax.jit(fn)(*placed)
  assert rel(out, reference(ids)(q, k, v)) < BF16_RMS

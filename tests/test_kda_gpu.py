"""The KDA Pallas kernels compiled for the GPU they run on (Triton; skipped elsewhere)
against the literal recurrence, with K3's bounded gate and Kimi Linear's softplus gate
(down to -60 a token), packed documents, bf16 inputs: the kernels' matmuls take bf16
operands, the reference the same bf16 values in fp32, so they differ by bf16 rounding
(fla's bounds, relative RMS). conftest.py selects the CPU unless told otherwise:

  JAX_PLATFORMS=cuda python -m pytest tests/test_kda_gpu.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel
from pallas_kernels.kda import kda_naive, kda_pallas

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

B, T, H, D = 2, 700, 2, 128
RTOL_BF16 = {"o": 5e-3, "state": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3,
             "g": 2e-2, "beta": 2e-2}


def inputs(softplus: bool):
  """bf16 q, k (unit norm), v, g, beta, fp32 h0 and cotangents; row 1 of the softplus gate
  has 40 tokens near -60 (whole decays of e^-2400 a chunk)."""
  rng = np.random.default_rng(3)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  if softplus:
    pre = f(B, T, H, D) * 3
    pre[1, 200:240] += 30.0
    g = -2.0 * np.logaddexp(0.0, pre)          # -A softplus(x), A = 2
  else:
    g = -5.0 / (1.0 + np.exp(-f(B, T, H, D) - 2.0))
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  return (bf(unit(f(B, T, H, D))), bf(unit(f(B, T, H, D))), bf(f(B, T, H, D)), bf(g),
          bf(1 / (1 + np.exp(-f(B, T, H)))), jnp.asarray(0.1 * f(B, H, D, D)),
          jnp.asarray(f(B, T, H, D)), jnp.asarray(0.1 * f(B, H, D, D)))


def outputs_and_grads(fn, q, k, v, g, beta, h0, cot_o, cot_s):
  """(o, final state) and the gradients of sum(cot_o o) + sum(cot_s S) by input."""
  def run(*args):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True),
                       *args)
    return out, vjp((cot_o.astype(out[0].dtype), cot_s))
  return jax.jit(run)(q, k, v, g, beta, h0)


@pytest.mark.parametrize("softplus", [False, True])
def test_kernels_match_recurrence_on_gpu(softplus):
  ids = np.ones((B, T), np.int32)
  ids[0, 333:] = 2
  seg = jnp.asarray(ids)
  args = inputs(softplus)
  if softplus:
    assert float(jnp.min(args[3])) < -60
  kernel = functools.partial(kda_pallas, segment_ids=seg, bounded_gate=not softplus)
  naive = functools.partial(kda_naive, segment_ids=seg)
  out, grads = outputs_and_grads(kernel, *args)
  f32 = [a.astype(jnp.float32) for a in args[:5]] + list(args[5:])
  out_ref, grads_ref = outputs_and_grads(naive, *f32)
  names = ("o", "state", "q", "k", "v", "g", "beta", "h0")
  for name, a, b in zip(names, (*out, *grads), (*out_ref, *grads_ref)):
    a = np.asarray(a, np.float32)
    assert np.all(np.isfinite(a)), name
    assert rel(a, b) < RTOL_BF16[name], (name, rel(a, b))

"""Each position's cross-entropy against its target, logsumexp(logits) - logits[target]:
`cross_entropy` dispatches to `reference.py` or the Triton kernel of `kernel.py`; the
gradient, (softmax(logits) - onehot(target)) times the cotangent, is XLA's either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.backends import check_backend
from pallas_kernels.cross_entropy.kernel import (cross_entropy_pallas, cross_entropy_pieces,
                                                 supports)
from pallas_kernels.cross_entropy.reference import cross_entropy_reference
from pallas_kernels.platform import target_platform
from pallas_kernels.shard_types import axis_size

__all__ = ["BACKENDS", "cross_entropy", "cross_entropy_pallas", "cross_entropy_reference"]

# "auto": "kernel" on GPU where the shapes fit the kernel, else "reference"
BACKENDS = ("reference", "kernel", "interpret", "auto")


def cross_entropy(logits: jax.Array, targets: jax.Array, *, backend: str = "reference",
                  mesh=None, batch_axis=None, seq_axis=None, vocab_axis=None,
                  platform=None) -> jax.Array:
  """`cross_entropy_reference` through `backend`: logits [B, T, V], targets [B, T] -> fp32
  [B, T]. The kernel runs per device under `shard_map` over batch_axis, seq_axis and
  vocab_axis; a split vocabulary's pieces combine across vocab_axis."""
  check_backend("cross-entropy", backend, BACKENDS)
  split = mesh is not None and any(a is not None for a in (batch_axis, seq_axis, vocab_axis))
  if backend == "auto":
    fits = supports(logits.shape[-1] // (axis_size(mesh, vocab_axis) if split else 1))
    backend = "kernel" if target_platform(mesh, platform) == "gpu" and fits else "reference"
  if backend == "reference":
    return cross_entropy_reference(logits, targets)
  interpret = backend == "interpret"

  def pieces(logits, targets):
    if not split or vocab_axis is None:
      return cross_entropy_pieces(logits, targets, interpret=interpret)
    start = jax.lax.axis_index(vocab_axis) * logits.shape[-1]
    lse, picked = cross_entropy_pieces(logits, targets, vocab_start=start, interpret=interpret)
    big = jax.lax.pmax(lse, vocab_axis)   # log sum_pieces exp(piece's logsumexp)
    safe = jnp.where(big == -jnp.inf, 0.0, big)
    lse = safe + jnp.log(jax.lax.psum(jnp.exp(lse - safe), vocab_axis))
    return lse, jax.lax.psum(picked, vocab_axis)

  if split:
    rows = P(batch_axis, seq_axis)
    # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
    pieces = jax.shard_map(pieces, mesh=mesh,
                           in_specs=(P(batch_axis, seq_axis, vocab_axis), rows),
                           out_specs=(rows, rows), check_vma=False)
  return _with_gradient(pieces)(logits, targets)


def _with_gradient(pieces):
  """logsumexp - picked from pieces (logits [..., V], targets [...] -> fp32 (logsumexp,
  picked) [...]), with the cross-entropy's gradient for the logits (none for the targets)."""
  def fwd(logits, targets):
    lse, picked = pieces(logits, targets)
    return lse - picked, (logits, targets, lse)

  @jax.custom_vjp
  def f(logits, targets):
    return fwd(logits, targets)[0]

  def bwd(res, g):
    logits, targets, lse = res
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    soft = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    d = g[..., None] * jnp.where(vocab == targets[..., None], soft - 1.0, soft)
    return d.astype(logits.dtype), None

  f.defvjp(fwd, bwd)
  return f

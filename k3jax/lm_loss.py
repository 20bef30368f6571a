"""The LM loss: cross-entropy of the LM head's logits, whole or a chunk of positions at a time.

Chunked, the loss never holds the [B, T, vocab] logits, and it differentiates itself: each
chunk's forward also computes that chunk's gradients (the logits' softmax minus the target,
then the head's two backward matmuls), so a backward pass only scales what the forward kept
and the LM head's matmul runs three times a chunk, not four as under remat."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from k3jax import axes
from pallas_kernels import cross_entropy as ce_ops

LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (head parameters, h [B, T, d]) -> logits


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  denominator: jax.Array | None = None, backend: str = "reference") -> jax.Array:
  """sum(nll * weights) / denominator in nats; logits [B, T, V], targets/weights [B, T].
  Default denominator: max(sum(weights), 1); microbatches pass the whole batch's. backend:
  `pallas_kernels.cross_entropy`'s, which reads the logits as they are."""
  spec = axes.logical_to_spec(("batch", "seq", "vocab"))
  nll = ce_ops.cross_entropy(logits, targets, backend=backend, mesh=axes.current_mesh(),
                             batch_axis=spec[0], seq_axis=spec[1], vocab_axis=spec[2])
  if denominator is None:
    denominator = token_count(weights)
  return jnp.sum(nll * weights) / denominator


def token_count(weights: jax.Array) -> jax.Array:
  """max(sum(weights), 1): the default denominator of a loss over `weights`."""
  return jnp.maximum(jnp.sum(weights), 1.0)


def chunked_cross_entropy(logits_fn: LogitsFn, head: Any, h: jax.Array, targets: jax.Array,
                          weights: jax.Array, denominator: jax.Array | None = None,
                          chunk: int = 0, backend: str = "reference") -> jax.Array:
  """`cross_entropy(logits_fn(head, h), ...)`, `chunk` positions at a time so only [B, chunk,
  V] logits exist. head: the LM head's parameters (a pytree, differentiated), h [B, T, d].
  With `seq` split over s devices each chunk takes a piece of every slice, so T must split
  into s x chunk. chunk 0 (or >= T): the whole logits, differentiated by JAX."""
  b, t, _ = h.shape
  if denominator is None:
    denominator = token_count(weights)
  if not chunk or chunk >= t:
    return cross_entropy(logits_fn(head, h), targets, weights, denominator, backend)
  s = axes.split_ways("seq")
  if t % (s * chunk):
    slices = f"{s} context slices of " if s > 1 else ""
    raise ValueError(f"chunked_cross_entropy: {t} positions do not split into {slices}"
                     f"chunks of {chunk}")
  n = t // (s * chunk)

  def pieces(x):  # [B, T, ...] -> [n, B, s chunk, ...], positions of all slices
    x = jnp.moveaxis(x.reshape(b, s, n, chunk, *x.shape[2:]), 2, 0)
    return x.reshape(n, b, s * chunk, *x.shape[4:])

  return _chunked_loss(logits_fn, backend, head, pieces(h), pieces(targets), pieces(weights),
                       denominator)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_loss(logits_fn, backend, head, h, targets, weights, denominator):
  """The loss over chunks h [n, B, c, d] (targets, weights [n, B, c]), without gradients."""
  def body(total, xs):
    h, targets, weights = xs
    loss = cross_entropy(logits_fn(head, h), targets, weights, denominator, backend)
    return total + loss, None

  return jax.lax.scan(body, jnp.zeros((), jnp.float32), (h, targets, weights))[0]


def _chunked_loss_fwd(logits_fn, backend, head, h, targets, weights, denominator):
  """The loss and, chunk by chunk, its gradients for the head (summed in fp32) and for h."""
  def body(carry, xs):
    total, d_head = carry
    h, targets, weights = xs
    logits, head_vjp = jax.vjp(logits_fn, head, h)
    loss, d_logits = jax.value_and_grad(cross_entropy)(logits, targets, weights, denominator,
                                                       backend)
    d_head_chunk, d_h = head_vjp(d_logits)
    d_head = jax.tree.map(lambda acc, d: acc + d.astype(jnp.float32), d_head, d_head_chunk)
    return (total + loss, d_head), d_h

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head)
  (total, d_head), d_h = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                      (h, targets, weights))
  return total, (d_head, d_h, head)


def _chunked_loss_bwd(logits_fn, backend, residuals, g):
  """Scales the forward's gradients by the loss's cotangent g; none for targets, weights or
  the denominator (data)."""
  del logits_fn, backend
  d_head, d_h, head = residuals
  d_head = jax.tree.map(lambda d, p: (g * d).astype(p.dtype), d_head, head)
  d_h = (g * d_h.astype(jnp.float32)).astype(d_h.dtype)
  return d_head, d_h, None, None, None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)

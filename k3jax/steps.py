"""The train and eval steps: loss, gradients, optimizer, and what lives outside the gradient.

Pure functions over (params, rest, opt_state, batch), jitted by the caller; params and
rest (the balancing biases) are `nnx.as_pure` states. A batch: "inputs", "targets",
"segment_ids" [B, T] int32, "weights" [B, T] fp32, optionally "media_*" [B, ...]."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax import axes
from k3jax.media import PackedMedia
from k3jax.model import K3Model


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  denominator: jax.Array | None = None) -> jax.Array:
  """sum(nll * weights) / denominator in nats; logits [B, T, V], targets/weights [B, T].
  Default denominator: max(sum(weights), 1); microbatches pass the whole batch's."""
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  # The target's logit by a select, not a gather: its gradient is a select too, where a
  # gather's is a scatter-add that deterministic XLA rewrites element by element over [B, T, V]
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
  if denominator is None:
    denominator = _token_count(weights)
  return jnp.sum((logz - picked) * weights) / denominator


def chunked_cross_entropy(logits_fn, h: jax.Array, targets: jax.Array, weights: jax.Array,
                          denominator: jax.Array | None = None, chunk: int = 0) -> jax.Array:
  """`cross_entropy(logits_fn(h), ...)` `chunk` positions at a time under remat, so only
  [B, chunk, V] logits exist. h [B, T, d]; with `seq` split over s devices each step takes
  a chunk of every slice, so T must split into s x chunk."""
  b, t, _ = h.shape
  if denominator is None:
    denominator = _token_count(weights)
  if not chunk or chunk >= t:
    return cross_entropy(logits_fn(h), targets, weights, denominator)
  s = axes.split_ways("seq")
  if t % (s * chunk):
    slices = f"{s} context slices of " if s > 1 else ""
    raise ValueError(f"chunked_cross_entropy: {t} positions do not split into {slices}"
                     f"chunks of {chunk}")

  def pieces(x):  # [B, T, ...] -> [T / (s chunk), B, s chunk, ...], positions of all slices
    x = jnp.moveaxis(x.reshape(b, s, t // (s * chunk), chunk, *x.shape[2:]), 2, 0)
    return x.reshape(t // (s * chunk), b, s * chunk, *x.shape[4:])

  @jax.checkpoint
  def piece_loss(h, targets, weights):  # the chunk's share of the numerator
    return cross_entropy(logits_fn(h), targets, weights, jnp.ones((), jnp.float32))

  def body(total, xs):
    return total + piece_loss(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (pieces(h), pieces(targets), pieces(weights)))
  return total / denominator


def batch_media(batch: dict) -> PackedMedia | None:
  """The batch's per-row media (leading axis B), or None for a text-only batch."""
  if "media_patches" not in batch:
    return None
  return PackedMedia(*(batch["media_" + f] for f in PackedMedia._fields))


def _token_count(weights: jax.Array) -> jax.Array:
  return jnp.maximum(jnp.sum(weights), 1.0)


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[B, ...] -> [microbatches, B / microbatches, ...], strided so no data moves."""
  def split(x):
    rows = x.shape[0] // microbatches
    return jnp.swapaxes(x.reshape(rows, microbatches, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def apply_views(params, views):
  """params with each leaf's `ComputeView` applied (`compute_views`)."""
  return jax.tree.map(lambda p, view: view(p), params, views)


def make_steps(graphdef, tx: optax.GradientTransformation, *, qk_clip_tau: float = 0.0,
               microbatches: int = 1, loss_chunk: int = 0, views: Any = None):
  """The jitted-to-be train and eval steps over (params, rest, opt_state, batch).
  Microbatches run under `jax.lax.scan` and sum to the batch's update. After the update:
  the balancing bias update and QK-Clip. out["loss"] is the LM loss (plus
  out["moe_aux_loss"] in the gradient). A non-finite step changes nothing, out["skipped"]
  = 1. views (`train.cast_params_once`): applied once per step, same gradients."""
  def loss_fn(params, rest, batch, denominator=None, tokens=None):
    """(LM + balancing loss, (LM loss, balancing loss, aux)); None denominators: this batch's."""
    model = nnx.merge(graphdef, params, rest)
    if views is not None:
      model.set_attributes(weights_prepared=True)
    media = batch_media(batch)
    h, aux = model.hidden(batch["inputs"], batch["segment_ids"], media)
    with jax.named_scope("lm_head_loss"):
      loss = chunked_cross_entropy(model.logits, h, batch["targets"], batch["weights"],
                                   denominator, loss_chunk)
    if tokens is None:
      tokens = _token_count(batch["segment_ids"] > 0)
    balance = model.balance_loss(aux, tokens)
    return loss if balance is None else loss + balance, (loss, balance, aux)

  def loss_and_grads(params, rest, batch):
    """(LM loss, balancing loss, aux, grads) of the batch, by microbatches."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    computed = params if views is None else apply_views(params, views)

    def in_param_dtypes(grads):  # a cast's transpose: what the model's own cast would pass
      return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    if microbatches == 1:
      (_, (loss, balance, aux)), grads = grad_fn(computed, rest, batch)
      return loss, balance, aux, in_param_dtypes(grads)
    denominator = _token_count(batch["weights"])
    tokens = _token_count(batch["segment_ids"] > 0)

    def accumulate(grads, mb):
      (_, parts), mb_grads = grad_fn(computed, rest, mb, denominator, tokens)
      return jax.tree.map(jnp.add, grads, in_param_dtypes(mb_grads)), parts

    grads, (losses, balances, auxes) = jax.lax.scan(
        accumulate, jax.tree.map(jnp.zeros_like, params),
        split_microbatches(batch, microbatches))
    balance = None if balances is None else jnp.sum(balances)
    return jnp.sum(losses), balance, K3Model.reduce_aux(auxes), grads

  def train_step(params, rest, opt_state, batch):
    loss, balance, aux, grads = loss_and_grads(params, rest, batch)
    with jax.named_scope("optimizer"):
      grad_norm = optax.tree.norm(grads)
      # one NaN/Inf anywhere poisons the norm
      objective = loss if balance is None else loss + balance
      finite = jnp.isfinite(objective) & jnp.isfinite(grad_norm)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      model = nnx.merge(graphdef, optax.apply_updates(params, updates), rest)
      load = model.update_balance(aux)
      clip = model.qk_clip(aux, qk_clip_tau)

      def keep(new, old):  # a select, not a branch: both sides exist anyway; it fuses in place
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

      params = keep(nnx.as_pure(nnx.state(model, nnx.Param)), params)
      rest = keep(nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param))), rest)
      opt_state = keep(new_opt_state, opt_state)
      out = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
             "skipped": (~finite).astype(jnp.int32), **load, **clip}
      if balance is not None:
        out["moe_aux_loss"] = balance
    return params, rest, opt_state, out

  def eval_step(params, rest, batch):
    if microbatches == 1:
      return loss_fn(params, rest, batch)[1][0]
    denominator = _token_count(batch["weights"])
    losses = jax.lax.map(lambda mb: loss_fn(params, rest, mb, denominator)[1][0],
                         split_microbatches(batch, microbatches))
    return jnp.sum(losses)

  return train_step, eval_step

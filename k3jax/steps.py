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

from k3jax.lm_loss import chunked_cross_entropy, token_count
from k3jax.media import PackedMedia
from k3jax.model import K3Model


def batch_media(batch: dict) -> PackedMedia | None:
  """The batch's per-row media (leading axis B), or None for a text-only batch."""
  if "media_patches" not in batch:
    return None
  return PackedMedia(*(batch["media_" + f] for f in PackedMedia._fields))


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[B, ...] -> [microbatches, B / microbatches, ...], strided so no data moves."""
  def split(x):
    rows = x.shape[0] // microbatches
    return jnp.swapaxes(x.reshape(rows, microbatches, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def apply_views(params, views):
  """params with each leaf's `ComputeView` applied (`compute_views`)."""
  return jax.tree.map(lambda p, view: view(p), params, views)


def unstack(params, stacks):
  """Each leaf with stacks[leaf] = n > 0 as the tuple of its n leading slices (None: none)."""
  if stacks is None:
    return params
  return jax.tree.map(lambda n, p: tuple(p[i] for i in range(n)) if n else p, stacks, params)


def restack(params, stacks):
  """`unstack`'s inverse."""
  if stacks is None:
    return params
  return jax.tree.map(lambda n, p: jnp.stack(p) if n else p, stacks, params)


def _loss_and_grads(loss_fn, params, rest, batch, microbatches: int, views, stacks):
  """(LM loss, balancing loss, aux, grads) of the batch by `make_steps`'s loss_fn, by
  microbatches; views and stacks: `make_steps`'s."""
  # cast and sliced once: the model's casts and its slices of the re-stacked leaves fold
  computed = unstack(params if views is None else apply_views(params, views), stacks)
  grad_fn = jax.value_and_grad(lambda p, *a: loss_fn(restack(p, stacks), *a), has_aux=True)

  def in_param_dtypes(grads):  # a cast's transpose: what the model's own cast would pass
    return jax.tree.map(lambda g, p: g.astype(p.dtype), restack(grads, stacks), params)

  if microbatches == 1:
    (_, (loss, balance, aux)), grads = grad_fn(computed, rest, batch)
    return loss, balance, aux, in_param_dtypes(grads)
  denominator = token_count(batch["weights"])
  tokens = token_count(batch["segment_ids"] > 0)

  def accumulate(grads, mb):
    (_, parts), mb_grads = grad_fn(computed, rest, mb, denominator, tokens)
    return jax.tree.map(jnp.add, grads, in_param_dtypes(mb_grads)), parts

  grads, (losses, balances, auxes) = jax.lax.scan(
      accumulate, jax.tree.map(jnp.zeros_like, params), split_microbatches(batch, microbatches))
  balance = None if balances is None else jnp.sum(balances)
  return jnp.sum(losses), balance, K3Model.reduce_aux(auxes), grads


def make_steps(graphdef, tx: optax.GradientTransformation, *, qk_clip_tau: float = 0.0,
               microbatches: int = 1, loss_chunk: int = 0, loss_backend: str = "reference",
               views: Any = None, stacks: Any = None):
  """The jitted-to-be train and eval steps over (params, rest, opt_state, batch).
  Microbatches run under `jax.lax.scan` and sum to the batch's update. After the update:
  the balancing bias update and QK-Clip. out["loss"] is the LM loss (plus
  out["moe_aux_loss"] in the gradient). A non-finite step changes nothing, out["skipped"]
  = 1. views (`train.cast_params_once`): applied once per step, same gradients. stacks
  (`K3Model.unrolled_stacks`): the layers a model unrolled in Python slices out of stacked
  leaves, sliced once per step, not in every microbatch; same gradients. loss_chunk,
  loss_backend: `chunked_cross_entropy`'s chunk and backend (`train.loss_*`)."""
  def loss_fn(params, rest, batch, denominator=None, tokens=None):
    """(LM + balancing loss, (LM loss, balancing loss, aux)); None denominators: this batch's."""
    model = nnx.merge(graphdef, params, rest)
    if views is not None:   # modules that prepare weights themselves (MXFP4) skip it
      model.set_attributes(weights_prepared=True, raise_if_not_found=False)
    media = batch_media(batch)
    h, aux = model.hidden(batch["inputs"], batch["segment_ids"], media)
    with jax.named_scope("lm_head_loss"):
      loss = chunked_cross_entropy(*model.lm_head_fn(), h, batch["targets"],
                                   batch["weights"], denominator, loss_chunk, loss_backend)
    if tokens is None:
      tokens = token_count(batch["segment_ids"] > 0)
    balance = model.balance_loss(aux, tokens)
    return loss if balance is None else loss + balance, (loss, balance, aux)

  def train_step(params, rest, opt_state, batch):
    loss, balance, aux, grads = _loss_and_grads(loss_fn, params, rest, batch, microbatches,
                                                views, stacks)
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
    denominator = token_count(batch["weights"])
    losses = jax.lax.map(lambda mb: loss_fn(params, rest, mb, denominator)[1][0],
                         split_microbatches(batch, microbatches))
    return jnp.sum(losses)

  return train_step, eval_step

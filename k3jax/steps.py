"""The train and eval steps: loss, gradients, optimizer, and what lives outside the gradient.

Pure functions over (params, rest, opt_state, batch), jitted by the caller (`k3jax.train`,
the benchmarks). `params` is the model's `nnx.Param` state and `rest` its other state (the
Quantile-Balancing biases), both pure (`nnx.as_pure`: arrays, no Variables); a batch holds
"inputs", "targets", "segment_ids" [B, T] int32 and "weights" [B, T] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Weighted mean next-token loss in nats. logits [B, T, V], targets/weights [B, T]."""
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum((logz - picked) * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_steps(graphdef, tx: optax.GradientTransformation, *, qk_clip_tau: float = 0.0):
  """The jitted-to-be train and eval steps over (params, rest, opt_state, batch).

  After the optimizer update the step applies what lives outside the gradient: the
  Quantile-Balancing bias update and QK-Clip (tau = qk_clip_tau; 0 only reports).

  A step whose loss or gradient is not finite changes nothing: params, optimizer state and
  biases come back as they went in, and out["skipped"] is 1 (0 otherwise).
  """

  def loss_fn(params, rest, batch):
    logits, aux = nnx.merge(graphdef, params, rest)(batch["inputs"], batch["segment_ids"])
    return cross_entropy(logits, batch["targets"], batch["weights"]), aux

  def train_step(params, rest, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # one NaN/Inf anywhere poisons the norm
    updates, new_opt_state = tx.update(grads, opt_state, params)
    model = nnx.merge(graphdef, optax.apply_updates(params, updates), rest)
    load = model.update_balance(aux)
    clip = model.qk_clip(aux, qk_clip_tau)

    def keep(new, old):  # a select, not a branch: both sides exist anyway; it fuses in place
      return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    params = keep(nnx.as_pure(nnx.state(model, nnx.Param)), params)
    rest = keep(nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param))), rest)
    opt_state = keep(new_opt_state, opt_state)
    out = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.global_norm(params),
           "skipped": (~finite).astype(jnp.int32), **load, **clip}
    return params, rest, opt_state, out

  def eval_step(params, rest, batch):
    return loss_fn(params, rest, batch)[0]

  return train_step, eval_step

"""Block Attention Residuals (K3_SPEC 3): each sublayer reads softmax attention over earlier
block outputs, h = sum_i alpha_i v_i, alpha = softmax(w . (RMSNorm(v_i) * g)), in fp32.

Two forms of the sources: `BlockState`, a fixed buffer [S, B, T, d] a scan can carry
(embedding, completed blocks, partial; traced counts), and `Slots`, each source its own
[B, T, d] with static counts, for a stack unrolled in Python: a read takes only the sources
that exist and a write adds into the partial alone, no buffer to update or copy."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import axes
from k3jax.axes import constrain
from k3jax.model.layers import ones, param, zeros
from pallas_kernels import attn_res as attn_res_ops

SBTE = ("sources", "batch", "seq", "embed")
BTE = ("batch", "seq", "embed")


class AttnResQuery(nnx.Module):
  """One sublayer's pseudo-query `query` [d] (init 0) and key gain `key_gain` [d] (init 1);
  `backend`: pallas_kernels.attn_res's."""

  def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32,
               backend: str = "reference", rngs: nnx.Rngs | None = None):
    self.query = param(rngs, zeros, (dim,), ("embed",), param_dtype)
    self.key_gain = param(rngs, ones, (dim,), ("embed",), param_dtype)
    self.eps, self.backend = eps, backend

  def __call__(self, sources, valid: jax.Array | None = None) -> jax.Array:
    return attend(sources, valid, self.query[...], self.key_gain[...], self.eps,
                  backend=self.backend)


def attend(sources, valid: jax.Array | None, query: jax.Array,
           key_gain: jax.Array, eps: float, backend: str = "reference") -> jax.Array:
  """Direct read: sources [S, B, T, d] or S arrays [B, T, d], valid [S] or None, query,
  key_gain [d] -> h [B, T, d]."""
  spec = axes.logical_to_spec(SBTE)
  if attn_res_ops.is_buffer(sources):
    sources = constrain(sources, SBTE)
  else:
    sources = tuple(constrain(x, BTE) for x in sources)
  h = attn_res_ops.attend(sources, valid, query, key_gain, eps, backend=backend,
                          mesh=axes.current_mesh(), batch_axis=spec[1], seq_axis=spec[2])
  return constrain(h, BTE)


# Block bookkeeping for a (possibly scanned) stack.


class BlockState(NamedTuple):
  sources: jax.Array   # [S_max, B, T, d]: embedding, completed blocks, running partial
  num_done: jax.Array  # int32 []: completed blocks n; the partial sum is slot n + 1
  in_block: jax.Array  # int32 []: sublayers written into the current block (0 = no partial)


def num_slots_for(num_layers: int, block_layers: int) -> int:
  """Buffer slots for `num_layers` layers in blocks of `block_layers`."""
  return 1 + num_layers // block_layers + 1


def init_state(embedding: jax.Array, num_slots: int) -> BlockState:
  """embedding [B, T, d] in slot 0, the rest zero, in the embedding's dtype."""
  if num_slots < 2:
    raise ValueError(f"init_state: need >= 2 slots (embedding + partial), got {num_slots}")
  sources = jnp.zeros((num_slots, *embedding.shape), embedding.dtype).at[0].set(embedding)
  return BlockState(constrain(sources, SBTE), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def valid_sources(state: BlockState) -> jax.Array:
  """[S] bool: the embedding, the completed blocks, and the partial sum if it is non-empty."""
  idx = jnp.arange(state.sources.shape[0])
  return (idx <= state.num_done) | ((idx == state.num_done + 1) & (state.in_block > 0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
  """The sources as separate arrays, counts static (a stack unrolled in Python)."""
  blocks: tuple[jax.Array, ...]   # the embedding and the completed blocks, [B, T, d] each
  partial: jax.Array | None       # the running partial sum, None while empty
  in_block: int = dataclasses.field(metadata=dict(static=True))  # sublayers in the partial

  @property
  def sources(self) -> tuple[jax.Array, ...]:
    return self.blocks + (() if self.partial is None else (self.partial,))


def init_slots(embedding: jax.Array) -> Slots:
  """The embedding [B, T, d] as the only source."""
  return Slots((embedding,), None, 0)


def read(state: BlockState | Slots, query: AttnResQuery) -> jax.Array:
  """The next sublayer's input h [B, T, d] (the partial sum only once non-empty)."""
  if isinstance(state, Slots):
    return query(state.sources)
  return query(state.sources, valid_sources(state))


def write(state: BlockState | Slots, out: jax.Array, block_sublayers: int
          ) -> BlockState | Slots:
  """Add a sublayer's output [B, T, d] to the partial sum; a block closes after
  `block_sublayers`. Size a BlockState with `num_slots_for`: traced indices are unchecked."""
  if isinstance(state, Slots):
    out = out.astype(state.blocks[0].dtype)
    partial = out if state.partial is None else state.partial + out
    if state.in_block + 1 >= block_sublayers:
      return Slots(state.blocks + (constrain(partial, BTE),), None, 0)
    return Slots(state.blocks, constrain(partial, BTE), state.in_block + 1)
  slot = state.num_done + 1
  partial = jax.lax.dynamic_index_in_dim(state.sources, slot, axis=0, keepdims=False)
  partial = jnp.where(state.in_block > 0, partial, jnp.zeros_like(partial))
  partial = partial + out.astype(state.sources.dtype)
  sources = jax.lax.dynamic_update_index_in_dim(state.sources, partial, slot, axis=0)
  in_block = state.in_block + 1
  done = in_block >= block_sublayers
  return BlockState(constrain(sources, SBTE),
                    jnp.where(done, state.num_done + 1, state.num_done).astype(jnp.int32),
                    jnp.where(done, 0, in_block).astype(jnp.int32))


def scan(step, state: BlockState, xs):
  """`jax.lax.scan(step, state, xs)` saving only the partial slot [B, T, d] per step, not
  the buffer; valid since `step` changes sources only through `write`, so the backward
  rebuilds each input from the final sources. Same outputs and gradients."""
  @jax.custom_vjp
  def run(state, xs):
    return jax.lax.scan(step, state, xs)

  def saving_step(state, x):
    new, y = step(state, x)
    partial = jax.lax.dynamic_index_in_dim(state.sources, state.num_done + 1, 0, keepdims=False)
    return new, (y, (partial, state.num_done, state.in_block))

  def fwd(state, xs):
    final, (ys, saved) = jax.lax.scan(saving_step, state, xs)
    return (final, ys), (final.sources, saved, xs)

  def bwd(res, cts):
    final_sources, saved, xs = res
    d_final, d_ys = cts
    slots = jnp.arange(final_sources.shape[0])
    d_leaves, y_def = jax.tree.flatten(d_ys)
    inexact = [d.dtype != jax.dtypes.float0 for d in d_leaves]
    zero = np.zeros((), jax.dtypes.float0)

    def back(d_sources, inp):
      (partial, num_done, in_block), x, d_y_inexact = inp
      sources = jnp.where((slots <= num_done)[:, None, None, None], final_sources, 0)
      sources = jax.lax.dynamic_update_index_in_dim(sources, partial, num_done + 1, 0)
      _, vjp = jax.vjp(step, BlockState(sources, num_done, in_block), x)
      it = iter(d_y_inexact)
      d_y = jax.tree.unflatten(y_def, [next(it) if keep else np.zeros(d.shape[1:], d.dtype)
                                       for d, keep in zip(d_leaves, inexact)])
      d_state, d_x = vjp((BlockState(d_sources, zero, zero), d_y))
      return d_state.sources, d_x

    d_sources, d_xs = jax.lax.scan(
        back, d_final.sources,
        (saved, xs, [d for d, keep in zip(d_leaves, inexact) if keep]), reverse=True)
    return BlockState(d_sources, zero, zero), d_xs

  run.defvjp(fwd, bwd)
  return run(state, xs)

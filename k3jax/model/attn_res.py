"""Block Attention Residuals (K3_SPEC 3): each sublayer reads its input as softmax
attention over earlier block outputs instead of one running residual.

  h = sum_i alpha_i v_i,  alpha = softmax_i over valid sources of  w . (RMSNorm(v_i) * g)

with a learned pseudo-query w (init 0, so the first read is a uniform average) and key
gain g (init 1) per sublayer; values are raw; logits and softmax in fp32.

Sources live in a fixed-size buffer so a scanned stack can carry them (`BlockState`):
slot 0 is the token embedding, slots 1..n the sums of the n completed blocks, slot n+1
the running partial sum of the current block. A block is `block_sublayers` sublayers
(attention and FFN count separately, so 2 * block_layers). Indices may be traced.

The two-phase inference form (`phase1`, `partial_stats`, `merge`) gives the same h: all
queries of a block against the completed blocks in one batch, then an online-softmax
merge with the partial-sum term.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.axes import constrain
from k3jax.model.layers import ones, param, zeros

SBTE = ("sources", "batch", "seq", "embed")
BTE = ("batch", "seq", "embed")


class AttnResQuery(nnx.Module):
  """The pseudo-query `query` [d] (init 0) and key RMSNorm gain `key_gain` [d] (init 1)
  of one sublayer (or of the output-level AttnRes)."""

  def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    self.query = param(rngs, zeros, (dim,), ("embed",), param_dtype)
    self.key_gain = param(rngs, ones, (dim,), ("embed",), param_dtype)
    self.eps = eps

  def __call__(self, sources: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    return attend(sources, valid, self.query[...], self.key_gain[...], self.eps)


def _logits(sources: jax.Array, queries: jax.Array, key_gains: jax.Array,
            eps: float) -> jax.Array:
  """w_q . (RMSNorm(v_i) * g_q) in fp32. sources [S, B, T, d], queries/gains [Q, d]
  -> [Q, S, B, T]. The gain is folded into the query: the normalised keys are shared."""
  v = sources.astype(jnp.float32)
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  wg = queries.astype(jnp.float32) * key_gains.astype(jnp.float32)
  return jnp.einsum("sbtd,qd->qsbt", keys, wg, precision=jax.lax.Precision.HIGHEST)


def _masked(logits: jax.Array, valid: jax.Array | None) -> jax.Array:
  """Logits [..., S, B, T] with invalid sources (valid [S] bool) set to -inf."""
  if valid is None:
    return logits
  return jnp.where(valid[:, None, None], logits, -jnp.inf)


def attend(sources: jax.Array, valid: jax.Array | None, query: jax.Array,
           key_gain: jax.Array, eps: float) -> jax.Array:
  """Direct AttnRes read. sources [S, B, T, d]; valid [S] bool (None = all; at least
  one must be valid); query, key_gain [d] -> h [B, T, d] in the sources' dtype."""
  sources = constrain(sources, SBTE)
  logits = _masked(_logits(sources, query[None], key_gain[None], eps)[0], valid)  # [S, B, T]
  alpha = jax.nn.softmax(logits, axis=0)
  h = jnp.einsum("sbt,sbtd->btd", alpha, sources.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return constrain(h.astype(sources.dtype), BTE)


# ---------------------------------------------------------------------------------------
# Block bookkeeping for a (possibly scanned) stack.


class BlockState(NamedTuple):
  sources: jax.Array   # [S_max, B, T, d]: embedding, completed blocks, running partial
  num_done: jax.Array  # int32 []: completed blocks n; the partial sum is slot n + 1
  in_block: jax.Array  # int32 []: sublayers written into the current block (0 = no partial)


def num_slots_for(num_layers: int, block_layers: int) -> int:
  """Slots a stack of `num_layers` layers (2 sublayers each) in blocks of `block_layers`
  layers needs: the embedding, every block that can complete, and the partial sum."""
  return 1 + num_layers // block_layers + 1


def init_state(embedding: jax.Array, num_slots: int) -> BlockState:
  """embedding [B, T, d] in slot 0, the rest zero. The buffer takes the embedding's dtype
  (pass an fp32 embedding for fp32 block sums)."""
  if num_slots < 2:
    raise ValueError(f"init_state: need >= 2 slots (embedding + partial), got {num_slots}")
  sources = jnp.zeros((num_slots, *embedding.shape), embedding.dtype).at[0].set(embedding)
  return BlockState(constrain(sources, SBTE), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def valid_sources(state: BlockState) -> jax.Array:
  """[S] bool: the embedding, the completed blocks, and the partial sum if it is non-empty."""
  idx = jnp.arange(state.sources.shape[0])
  return (idx <= state.num_done) | ((idx == state.num_done + 1) & (state.in_block > 0))


def read(state: BlockState, query: AttnResQuery) -> jax.Array:
  """The input h [B, T, d] of the next sublayer (or, with the output-level query, the
  stack's output). The first sublayer of a block sees only the embedding and completed
  blocks; later ones also the partial sum."""
  return query(state.sources, valid_sources(state))


def write(state: BlockState, out: jax.Array, block_sublayers: int) -> BlockState:
  """Add a sublayer's output [B, T, d] to the partial sum; after `block_sublayers`
  writes the partial becomes completed block n + 1 and the next write starts a new one.
  The caller must size the buffer with `num_slots_for` (traced indices cannot be
  bounds-checked; dynamic_update_slice would clamp)."""
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
  """`jax.lax.scan(step, state, xs)` for a `step(state, x) -> (state, y)` that changes the
  sources only through `write` (the partial slot; a completed block is never written again),
  with the same outputs and gradients but a smaller residual: per step it saves the partial
  slot [B, T, d] and the two counters, not the whole buffer [S, B, T, d] (k3_full: 22 x
  0.49 GiB -> 22 x 0.05 GiB per device). The backward rebuilds each step's input from the
  final sources (the completed slots it had are final by then; later slots are zero) and
  that partial, then differentiates the step there (under its own remat, if any).

  y may hold integer leaves (their cotangents are zero)."""
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
    inexact = [d.dtype != jax.dtypes.float0 for d in d_leaves]  # integer y: float0 cotangents
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


# ---------------------------------------------------------------------------------------
# Two-phase inference form. o is the UNNORMALISED sum  sum_i e^{s_i - m} v_i  and
# l = sum_i e^{s_i - m}, so h = o / l and two parts merge exactly as spec 3 writes it.


def phase1(sources: jax.Array, valid: jax.Array | None, queries: jax.Array,
           key_gains: jax.Array, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """All Q pseudo-queries of a block against the completed sources at once.

  sources [S, B, T, d]; valid [S] bool (at least one valid); queries, key_gains [Q, d]
  -> o1 [Q, B, T, d] (unnormalised), m1 [Q, B, T] (max logit), l1 [Q, B, T], all fp32.
  """
  logits = _masked(_logits(sources, queries, key_gains, eps), valid)     # [Q, S, B, T]
  m = jnp.max(logits, axis=1)
  p = jnp.exp(logits - m[:, None])
  o = jnp.einsum("qsbt,sbtd->qbtd", p, sources.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return o, m, jnp.sum(p, axis=1)


def partial_stats(partial: jax.Array, query: jax.Array, key_gain: jax.Array,
                  eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(o2, m2, l2) of the single partial-sum source [B, T, d]: (v, s, 1), fp32."""
  m = _logits(partial[None], query[None], key_gain[None], eps)[0, 0]     # [B, T]
  return partial.astype(jnp.float32), m, jnp.ones_like(m)


def merge(o1: jax.Array, m1: jax.Array, l1: jax.Array, o2: jax.Array, m2: jax.Array,
          l2: jax.Array) -> jax.Array:
  """h = (e^{m1-M} o1 + e^{m2-M} o2) / (e^{m1-M} l1 + e^{m2-M} l2), M = max(m1, m2).

  o [..., d] unnormalised, m and l [...]; returns h [..., d] in fp32."""
  big = jnp.maximum(m1, m2)
  a1, a2 = jnp.exp(m1 - big), jnp.exp(m2 - big)
  num = a1[..., None] * o1 + a2[..., None] * o2
  return num / (a1 * l1 + a2 * l2)[..., None]

"""Each position's cross-entropy as a Pallas Triton kernel that reads the logits once: a program
per block of rows walks the vocabulary a block at a time, keeping each row's running max and
its sum of exp(x - max) in fp32, then reads the target's logit alone (XLA's form reads the
logits twice, once per reduction). Returns the two pieces, logsumexp and the picked logit,
so a vocabulary split over devices combines them."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.platform import lowered_once, triton_call

F32 = jnp.float32
BLOCK_ROWS, BLOCK_V = 2, 2048


def supports(vocab: int) -> bool:
  """Whether the kernel takes logits [..., vocab] (any number of rows: a block of rows
  shrinks to one): its vocabulary blocks must divide it (it reads no padding, which would be
  a pass over the logits of its own)."""
  return vocab % 128 == 0


def _blocks(rows: int, vocab: int, block_rows: int, block_v: int) -> tuple[int, int]:
  """The largest divisors of (block_rows, block_v) that divide (rows, vocab)."""
  return math.gcd(rows, block_rows), math.gcd(vocab, block_v)


def _kernel(x_ref, t_ref, lse_ref, picked_ref, *, block_v):
  rows, vocab = x_ref.shape
  target = t_ref[...]

  def step(j, carry):
    big, total = carry
    x = x_ref[:, pl.ds(pl.multiple_of(j * block_v, block_v), block_v)].astype(F32)
    new = jnp.maximum(big, jnp.max(x, axis=1))
    # a row still all -inf keeps (-inf, 0): exp(-inf - -inf) would be NaN
    safe = jnp.where(new == -jnp.inf, 0.0, new)
    total = total * jnp.exp(big - safe) + jnp.sum(jnp.exp(x - safe[:, None]), axis=1)
    return new, total

  init = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32))
  big, total = jax.lax.fori_loop(0, vocab // block_v, step, init)
  lse_ref[...] = big + jnp.log(total)
  inside = (target >= 0) & (target < vocab)
  at = x_ref[jnp.arange(rows), jnp.clip(target, 0, vocab - 1)].astype(F32)
  picked_ref[...] = jnp.where(inside, at, 0.0)


@lowered_once(2, 3, 4, 5)
def _call(x, targets, block_rows, block_v, num_warps, interpret):
  rows, vocab = x.shape
  row_block = pl.BlockSpec((block_rows,), lambda i: (i,))
  return triton_call(
      functools.partial(_kernel, block_v=block_v), x, targets, grid=(rows // block_rows,),
      in_specs=[pl.BlockSpec((block_rows, vocab), lambda i: (i, 0)), row_block],
      out_specs=[row_block, row_block],
      out_shape=[jax.ShapeDtypeStruct((rows,), F32)] * 2, interpret=interpret,
      num_warps=num_warps, num_stages=3)


def cross_entropy_pieces(logits: jax.Array, targets: jax.Array, *, vocab_start=0,
                         block_rows: int = BLOCK_ROWS, block_v: int = BLOCK_V,
                         num_warps: int = 4, interpret: bool = False
                         ) -> tuple[jax.Array, jax.Array]:
  """(logsumexp(logits), logits[targets - vocab_start], 0 where that is outside [0, V)), fp32
  [...] each, for logits [..., V] holding the vocabulary from vocab_start; no gradient (the
  dispatcher gives one). A program takes block_rows rows, block_v entries at a time (each
  cut to its largest divisor that divides the shape, `_blocks`)."""
  *lead, vocab = logits.shape
  rows = math.prod(lead)
  if not supports(vocab):
    raise ValueError(f"cross_entropy kernel: a vocabulary of {vocab} entries does not split "
                     "into its blocks (multiples of 128)")
  local = (targets - vocab_start).astype(jnp.int32).reshape(rows)
  block_rows, block_v = _blocks(rows, vocab, block_rows, block_v)
  lse, picked = _call(logits.reshape(rows, vocab), local, block_rows, block_v, num_warps,
                      interpret)
  return lse.reshape(lead), picked.reshape(lead)


def cross_entropy_pallas(logits: jax.Array, targets: jax.Array, **settings) -> jax.Array:
  """`cross_entropy_reference` through the kernel, without a gradient; settings: those of
  `cross_entropy_pieces`."""
  lse, picked = cross_entropy_pieces(logits, targets, **settings)
  return lse - picked

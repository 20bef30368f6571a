"""The LM loss over whole logits on one GPU: `k3jax.lm_loss.cross_entropy` with the Triton
kernel of `pallas_kernels.cross_entropy` (one read of the logits) against its XLA reference
(a read for the max, another for the sum and the pick), on bf16 logits [B, T, V] as the LM
head writes them.

Prints the agreement of the loss and of the logits' gradient with the reference on fp32
logits, and median times of the loss alone and of the loss and its gradient, with GB/s on
the least traffic each needs (the loss: read the logits once; with the gradient: read them
twice and write the bf16 gradient).

    python benchmarks/lm_loss.py --shapes 4,4096,163840 8,4096,163840

`--blocks 4,2048,4 8,4096,8` also times the kernel alone (no gradient) per tiling: rows a
program, vocabulary entries a step, warps.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from harness import header, rel_rms, time_jax, write_table
from k3jax import lm_loss
from pallas_kernels.cross_entropy import cross_entropy_pallas


def inputs(shape, seed=0):
  """bf16 logits [B, T, V] with the spread of a trained head's, targets and weights."""
  b, t, v = shape
  k1, k2 = jax.random.split(jax.random.key(seed))
  logits = (4.0 * jax.random.normal(k1, shape, jnp.float32)).astype(jnp.bfloat16)
  targets = jax.random.randint(k2, (b, t), 0, v, jnp.int32)
  return logits, targets, jnp.ones((b, t), jnp.float32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", nargs="+", default=["4,4096,163840"])
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--blocks", nargs="*", default=[], help="kernel tilings rows,vocab,warps")
  p.add_argument("--out", default=None)
  a = p.parse_args()
  lines = [header("LM loss over whole bf16 logits"), "",
           "| B, T, V | form | loss ms | GB/s | loss + grad ms | GB/s | loss err | grad err |",
           "|---|---|---|---|---|---|---|---|"]
  for spec in a.shapes:
    shape = tuple(int(s) for s in spec.split(","))
    logits, targets, weights = inputs(shape)
    size = logits.size * 2
    ref, ref_grad = jax.jit(jax.value_and_grad(lm_loss.cross_entropy))(
        logits.astype(jnp.float32), targets, weights)
    for backend in ("kernel", "reference"):
      fn = functools.partial(lm_loss.cross_entropy, backend=backend)
      loss = jax.jit(fn)
      grad = jax.jit(lambda x, t, w, fn=fn: jax.value_and_grad(fn)(x, t, w))
      got, got_grad = grad(logits, targets, weights)
      fwd_ms = time_jax(loss, (logits, targets, weights), a.reps)
      both_ms = time_jax(grad, (logits, targets, weights), a.reps)
      lines.append(
          f"| {spec} | {backend} | {fwd_ms:.3f} | {size / fwd_ms / 1e6:.0f} | {both_ms:.3f} | "
          f"{3 * size / both_ms / 1e6:.0f} | {abs(float(got) - float(ref)) / float(ref):.1e} | "
          f"{rel_rms(np.asarray(got_grad, np.float32), ref_grad):.1e} |")
    for blocks in a.blocks:
      rows, block_v, warps = (int(n) for n in blocks.split(","))
      fn = jax.jit(functools.partial(cross_entropy_pallas, block_rows=rows, block_v=block_v,
                                     num_warps=warps))
      ms = time_jax(fn, (logits, targets), a.reps)
      lines.append(f"| {spec} | kernel alone, blocks {blocks} | {ms:.3f} | "
                   f"{size / ms / 1e6:.0f} | | | | |")
  write_table(lines, a.out)


if __name__ == "__main__":
  main()

"""MLA attention under context parallelism on GPUs: what one device computes for its slice.

With T split over c devices, the GPU path (`pallas_kernels.attention`) trades each device's
T/c positions of all heads for all T of H/c heads (all-to-alls over the context axis) and
runs the unsplit kernels there; where the heads do not split it gathers T, and each device
computes all T of all heads. Per T and c (k3_small's MLA: 16 heads, Dqk 192, Dv 128; bf16;
two documents a row), forward + backward of the flash kernel with the QK-Clip max logit:

  device work   the dispatcher on one device over all T for H/c heads: exactly the local
                computation of the exchanged path (c = 1: what the gathered path does on
                every device, for any c);
  exchanged     with --devices N > 1: the dispatcher itself, T split over N devices;
  moved         bytes each device sends through the all-to-alls a layer, forward (q, k, v
                in, the output back; the backward sends as many).

    python benchmarks/context_attention.py --tokens 131072 --contexts 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from harness import time_jax
from pallas_kernels.attention import attention

H, DQK, DV = 16, 192, 128


def inputs(t, heads, seed=0):
  """bf16 q, k [1, t, heads, DQK], v and the output cotangent [1, t, heads, DV]; ids [1, t]:
  a third, then the rest."""
  rng = np.random.default_rng(seed)
  x = lambda d: jnp.asarray(rng.standard_normal((1, t, heads, d)), jnp.bfloat16)  # noqa: E731
  ids = np.ones((1, t), np.int32)
  ids[:, t // 3:] = 2
  return x(DQK), x(DQK), x(DV), x(DV), jnp.asarray(ids)


def fwd_bwd(**where):
  def run(q, k, v, do, ids):
    def fn(q, k, v):
      return attention(q, k, v, ids, scale=DQK ** -0.5, causal=True, backend="kernel",
                       return_max_logit=True, **where)
    (out, logit), vjp = jax.vjp(fn, q, k, v)
    return (out, logit) + vjp((do, jnp.zeros_like(logit)))
  return jax.jit(run)


def moved_bytes(t, c) -> int:
  """Bytes a device sends a layer, forward: (c - 1) / c of its q, k, v and output slices."""
  return (t // c) * H * (2 * DQK + 2 * DV) * 2 * (c - 1) // c


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", nargs="+", type=int, default=[131072])
  parser.add_argument("--contexts", nargs="+", type=int, default=[1, 2, 4, 8, 16])
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--reps", type=int, default=2)
  args = parser.parse_args()
  run = dict(jax=jax.__version__, device=jax.devices()[0].device_kind)
  for t in args.tokens:
    for c in args.contexts:
      row = dict(run, T=t, c=c, heads_per_device=H // c,
                 moved_gib=round(moved_bytes(t, c) / 2**30, 3))
      row["device_work_ms"] = round(time_jax(fwd_bwd(), inputs(t, H // c), args.reps), 2)
      if args.devices > 1 and c == args.devices:
        mesh = Mesh(np.asarray(jax.devices()[:c]), ("context",))
        split = NamedSharding(mesh, P(None, "context"))
        placed = [jax.device_put(x, split) for x in inputs(t, H)]
        row["exchanged_ms"] = round(time_jax(
            fwd_bwd(mesh=mesh, seq_axis="context"), placed, args.reps), 2)
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()

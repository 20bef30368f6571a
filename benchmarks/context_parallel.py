"""KDA under context parallelism on the GPUs of one host: what a device's slice costs.

Per shape (B, T, H, D), bf16, two documents a row, forward + backward (the VJP of a fixed
cotangent), timed back to back (`kda.time_jax`):
  slice      `kda` on one device over T / N tokens: the work of a slice, no chaining;
  context    `kda` with T split over the N devices (`seq_axis`): each slice run once with
             the state widened to [K, V + K], the maps chained across devices. With one
             device (N = 1) the chain is empty and this times the widened pass alone.
The ratio context / slice is the cost of context parallelism in KDA. Prints one JSON line
per shape, and the error of the context run against the unsplit fp32 chunked form.

    python3 benchmarks/context_parallel.py --shapes 2,8192,16,128 1,32768,16,128
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from harness import rel_rms, time_jax
from pallas_kernels import kda as kda_ops


def inputs(B, T, H, D, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
  seg = np.repeat([[1, 2]], [T // 3, T - T // 3], axis=1).repeat(B, 0).astype(np.int32)
  return dict(q=unit(f(B, T, H, D)), k=unit(f(B, T, H, D)), v=f(B, T, H, D),
              g=-5 / (1 + np.exp(-f(B, T, H, D))), beta=1 / (1 + np.exp(-f(B, T, H))),
              do=f(B, T, H, D), seg=seg)


def fwd_bwd(seg, **kw):
  def run(q, k, v, g, beta, do):
    o, vjp = jax.vjp(lambda *a: kda_ops.kda(*a, segment_ids=seg, **kw), q, k, v, g, beta)
    return (o,) + vjp(do)
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["2,8192,16,128"])
  parser.add_argument("--backend", default="kernel")
  parser.add_argument("--reps", type=int, default=10)
  args = parser.parse_args()
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("context",))
  for shape in args.shapes:
    B, T, H, D = map(int, shape.split(","))
    x = inputs(B, T, H, D)
    names = ("q", "k", "v", "g", "beta", "do")
    bf = {k: jnp.asarray(x[k], jnp.bfloat16) for k in names}
    t = T // n
    local = [bf[k][:, :t] for k in names]
    slice_ms = time_jax(fwd_bwd(jnp.asarray(x["seg"][:, :t]), backend=args.backend),
                        local, args.reps)
    split = NamedSharding(mesh, P(None, "context"))
    placed = [jax.device_put(bf[k], split) for k in names]
    seg = jax.device_put(jnp.asarray(x["seg"]), split)
    run = fwd_bwd(seg, backend=args.backend, mesh=mesh, seq_axis="context")
    context_ms = time_jax(run, placed, args.reps)
    got = run(*placed)
    want = fwd_bwd(jnp.asarray(x["seg"]), backend="reference")(
        *[jnp.asarray(x[k]) for k in names])
    print(json.dumps(dict(
        device=devices[0].device_kind, devices=n, jax=jax.__version__, shape=[B, T, H, D],
        backend=args.backend, slice_tokens=t, slice_fwd_bwd_ms=round(slice_ms, 3),
        context_fwd_bwd_ms=round(context_ms, 3), ratio=round(context_ms / slice_ms, 3),
        err={name: round(rel_rms(np.asarray(a, np.float32), np.asarray(b)), 5)
             for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want)})),
          flush=True)


if __name__ == "__main__":
  main()

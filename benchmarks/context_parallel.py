"""KDA under context parallelism on the GPUs of one host: what a device's slice costs.

Per shape (B, T, H, D), bf16, two documents a row, forward + backward (the VJP of a fixed
cotangent), timed back to back (`kda.time_jax`):
  slice      `kda` on one device over T / N tokens: the work of a slice, no chaining;
  context    `kda` with T split over the N devices (`seq_axis`): the kernels chain their
             own spans' transitions across devices (`context_kernel.py`);
  two-pass   the same split run as any backend is (`context.kda_context`: each slice twice,
             from zero and from the identity), the form the kernels used before.
With one device (N = 1) the chains are empty and the columns time a device's own work.
The ratios to slice are the cost of context parallelism in KDA. Prints one JSON line per
shape, and the error of the context run against the unsplit fp32 chunked form.

    python3 benchmarks/context_parallel.py --shapes 2,8192,16,128 1,32768,16,128
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from harness import rel_rms, time_jax
from pallas_kernels import kda as kda_ops
from pallas_kernels.kda.context import kda_context_sharded


def inputs(B, T, H, D, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
  seg = np.repeat([[1, 2]], [T // 3, T - T // 3], axis=1).repeat(B, 0).astype(np.int32)
  return dict(q=unit(f(B, T, H, D)), k=unit(f(B, T, H, D)), v=f(B, T, H, D),
              g=-5 / (1 + np.exp(-f(B, T, H, D))), beta=1 / (1 + np.exp(-f(B, T, H))),
              do=f(B, T, H, D), seg=seg)


def fwd_bwd(op):
  """jit of (inputs, do, segment ids) -> (o, dq, dk, dv, dg, dbeta) of op(q, k, v, g, beta,
  segment_ids); ids traced, not constants (XLA would fold a constant row's document masks
  for minutes at 128k)."""
  def run(q, k, v, g, beta, do, seg):
    o, vjp = jax.vjp(lambda *a: op(*a, seg), q, k, v, g, beta)
    return (o,) + vjp(do)
  return jax.jit(run)


def plain(**kw):
  return fwd_bwd(lambda *a: kda_ops.kda(*a[:5], segment_ids=a[5], **kw))


def split_over(local, mesh):
  """fwd_bwd of the split with `local` running each device's slice."""
  return fwd_bwd(lambda *a: kda_context_sharded(local, *a[:5], segment_ids=a[5], mesh=mesh,
                                                seq_axis="context"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["2,8192,16,128"])
  parser.add_argument("--backend", default="kernel")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--transition_blocks", nargs="*", type=int, default=[],
                      help="also time the context run with these rows per transition program")
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
    local = [bf[k][:, :t] for k in names] + [jnp.asarray(x["seg"][:, :t])]
    slice_ms = time_jax(plain(backend=args.backend), local, args.reps)
    split = NamedSharding(mesh, P(None, "context"))
    placed = [jax.device_put(a, split) for a in [bf[k] for k in names] + [x["seg"]]]
    run = plain(backend=args.backend, mesh=mesh, seq_axis="context")
    context_ms = time_jax(run, placed, args.reps)
    interpret = args.backend == "interpret"
    two_pass = functools.partial(kda_ops.kda_context,
                                 functools.partial(kda_ops.kda_pallas, interpret=interpret))
    two_pass_ms = time_jax(split_over(two_pass, mesh), placed, args.reps)
    by_block = {b: round(time_jax(split_over(functools.partial(
        kda_ops.kda_pallas_context, interpret=interpret, transition_block=b), mesh),
        placed, args.reps), 3) for b in args.transition_blocks}
    got = run(*placed)
    want = plain(backend="reference")(*[jnp.asarray(x[k]) for k in names + ("seg",)])
    print(json.dumps(dict(
        device=devices[0].device_kind, devices=n, jax=jax.__version__, shape=[B, T, H, D],
        backend=args.backend, slice_tokens=t, slice_fwd_bwd_ms=round(slice_ms, 3),
        context_fwd_bwd_ms=round(context_ms, 3), ratio=round(context_ms / slice_ms, 3),
        two_pass_fwd_bwd_ms=round(two_pass_ms, 3), two_pass_ratio=round(two_pass_ms / slice_ms, 3),
        context_ms_by_transition_block=by_block,
        err={name: round(rel_rms(np.asarray(a, np.float32), np.asarray(b)), 5)
             for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want)})),
          flush=True)


if __name__ == "__main__":
  main()

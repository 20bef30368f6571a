"""The Block AttnRes read on one GPU: the Triton kernels against the plain-JAX reference
(XLA) on the same inputs, forward and forward + backward.

Per shape (S sources, B, T, d; bf16 sources as the model holds them, the last slot masked
as a partial sum not yet written): the agreement of h, d_sources and d_query with the fp32
reference (relative RMS), median times, and GB/s on the least traffic a fused form needs
(forward: read the sources, write h; backward: read the sources and dh, write d_sources).

Run on the H200:
    python3 benchmarks/attn_res.py --shapes 5,2,4096,2048 6,1,8192,2048
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from harness import rel_rms, time_jax
from pallas_kernels.attn_res import attend_pallas, attend_reference

EPS = 1e-5


def inputs(S, B, T, d, seed=0):
  """float32 arrays holding bf16 values: sources [S, B, T, d], dh [B, T, d], query and gain
  [d]; valid [S] with the last slot masked."""
  rng = np.random.default_rng(seed)
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
  return dict(sources=bf16(rng.standard_normal((S, B, T, d), dtype=np.float32)),
              dh=bf16(rng.standard_normal((B, T, d), dtype=np.float32)),
              query=0.1 * rng.standard_normal(d).astype(np.float32),
              gain=(1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
              valid=np.arange(S) < S - 1)


def fns(attend):
  def fwd(sources, valid, query, gain):
    return attend(sources, valid, query, gain, EPS)

  def fwd_bwd(sources, valid, query, gain, dh):
    h, vjp = jax.vjp(lambda s, q, g: fwd(s, valid, q, g), sources, query, gain)
    return (h,) + vjp(dh)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def run(inp, attend, reps, dtype):
  args = [jnp.asarray(inp["sources"], dtype), jnp.asarray(inp["valid"]),
          jnp.asarray(inp["query"]), jnp.asarray(inp["gain"])]
  fwd, fwd_bwd = fns(attend)
  out = fwd_bwd(*args, jnp.asarray(inp["dh"], dtype))
  res = {n: np.asarray(jnp.asarray(a, jnp.float32)) for n, a in zip(("h", "ds", "dq"), out)}
  res["fwd_ms"] = time_jax(fwd, args, reps)
  res["fwd_bwd_ms"] = time_jax(fwd_bwd, args + [jnp.asarray(inp["dh"], dtype)], reps)
  return res


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["5,2,4096,2048"])
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--blocks", nargs="*", default=[],
                      help="also time the kernels at these 'tokens,d_tile,warps' settings")
  args = parser.parse_args()
  for shape in args.shapes:
    S, B, T, d = map(int, shape.split(","))
    inp = inputs(S, B, T, d)
    exact = run(inp, attend_reference, 1, jnp.float32)
    row = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=[S, B, T, d])
    fwd_bytes = (S + 1) * B * T * d * 2
    bwd_bytes = (2 * S + 1) * B * T * d * 2
    for name, attend in (("kernel", attend_pallas), ("xla", attend_reference)):
      res = run(inp, attend, args.reps, jnp.bfloat16)
      row[name] = dict(fwd_ms=round(res["fwd_ms"], 3), fwd_bwd_ms=round(res["fwd_bwd_ms"], 3),
                       fwd_gbs=round(fwd_bytes / res["fwd_ms"] / 1e6),
                       fwd_bwd_gbs=round((fwd_bytes + bwd_bytes) / res["fwd_bwd_ms"] / 1e6),
                       err={k: round(rel_rms(res[k], exact[k]), 5) for k in ("h", "ds", "dq")})
    row["fwd_bwd_speedup"] = round(row["xla"]["fwd_bwd_ms"] / row["kernel"]["fwd_bwd_ms"], 2)
    for blocks in args.blocks:
      n, t, w = map(int, blocks.split(","))
      res = run(inp, functools.partial(attend_pallas, block_n=n, block_d=t, num_warps=w),
                args.reps, jnp.bfloat16)
      row[f"kernel {blocks}"] = dict(fwd_ms=round(res["fwd_ms"], 3),
                                     fwd_bwd_ms=round(res["fwd_bwd_ms"], 3))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()

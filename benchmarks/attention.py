"""MLA attention on one GPU: each flash kernel's forward + backward, and the QK-Clip max
logit, timed per shape.

  python benchmarks/attention.py --shapes 1,4096 2,32768 1,131072

Per shape (B rows of T tokens; 16 heads, Dqk 192, Dv 128: k3_small's MLA), bf16, causal,
and per --documents: 1 (each row one document, 1/16 padding at the end) or 2 (a third and
the rest, then the padding). Backends:
  cuda      `flash_cuda`, the GPU flash path: cuDNN unpacked (1) or packed (2)
  triton    `flash_gpu`, JAX's Triton `mha` (v padded to Dqk, head dims to 256)
  reference `attention_reference` ([B, H, T, T] fp32 scores; T <= --reference_max)
and for the max logit: `max_logit_gpu` (Triton) and `max_logit` (the JAX tile loop).
TFLOP/s count the causal work inside the documents: forward 2 (Dqk + Dv) per seen pair,
forward + backward 3.5x that; the max logit 2 Dqk. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from harness import time_jax
from pallas_kernels.attention import (attention_reference, flash_cuda, flash_gpu, max_logit,
                                      max_logit_gpu, unique_padding_ids)

H, DQK, DV = 16, 192, 128


def inputs(b, t, documents, seed=0):
  rng = np.random.default_rng(seed)
  x = lambda d: jnp.asarray(rng.standard_normal((b, t, H, d)), jnp.bfloat16)  # noqa: E731
  ids = np.ones((b, t), np.int32)
  ids[:, t // 3:] = documents
  ids[:, t - t // 16:] = 0
  return x(DQK), x(DQK), x(DV), x(DV), jnp.asarray(ids)


def seen_pairs(ids) -> float:
  """Query-key pairs the causal document mask lets through, summed over rows."""
  ids = np.asarray(ids)
  return float(sum(n * (n + 1) / 2 for row in ids
                   for doc, n in zip(*np.unique(row, return_counts=True)) if doc))


def kernels(ids, scale):
  unique = unique_padding_ids(ids)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  return {
      "cuda": lambda q, k, v: flash_cuda(q, k, v, unique, scale=scale, causal=True),
      "triton": lambda q, k, v: flash_gpu(q, k, v, unique, scale=scale, causal=True),
      "reference": lambda q, k, v: attention_reference(f32(q), f32(k), f32(v), ids,
                                                       scale=scale, causal=True)[0].astype(v.dtype),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["1,4096", "2,32768"])
  parser.add_argument("--documents", nargs="+", type=int, default=[1, 2])
  parser.add_argument("--backends", default="cuda,triton,reference")
  parser.add_argument("--reference_max", type=int, default=8192)
  parser.add_argument("--triton_max", type=int, default=32768)
  parser.add_argument("--logit_configs", nargs="*",
                      default=["128,64,8,2", "128,64,4,3", "128,32,4,2", "256,64,8,2"],
                      help="max_logit_gpu's block_q,block_k,num_warps,num_stages")
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  print(json.dumps({"jax": jax.__version__, "device": jax.devices()[0].device_kind}))
  scale = DQK ** -0.5
  for shape, documents in itertools.product(args.shapes, args.documents):
    b, t = map(int, shape.split(","))
    q, k, v, do, ids = inputs(b, t, documents)
    pairs = seen_pairs(ids) * H
    fwd_flops = 2 * (DQK + DV) * pairs
    row = {"B": b, "T": t, "documents": documents}
    for name, fn in kernels(ids, scale).items():
      if name not in args.backends.split(",") or (
          name == "reference" and t > args.reference_max) or (
          name == "triton" and t > args.triton_max):
        continue
      def fwd_bwd(q, k, v, do, fn=fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out,) + vjp(do)
      ms_f = time_jax(jax.jit(fn), (q, k, v), reps=args.reps)
      ms_fb = time_jax(jax.jit(fwd_bwd), (q, k, v, do), reps=args.reps)
      print(json.dumps({**row, "kernel": name, "fwd_ms": round(ms_f, 3),
                        "fwd_bwd_ms": round(ms_fb, 3),
                        "fwd_tflops": round(fwd_flops / ms_f / 1e9, 1),
                        "fwd_bwd_tflops": round(3.5 * fwd_flops / ms_fb / 1e9, 1)}), flush=True)
    logit_flops = 2 * DQK * pairs
    logit = {f"triton {c}": functools.partial(max_logit_gpu, **dict(zip(
        ("block_q", "block_k", "num_warps", "num_stages"), map(int, c.split(",")))))
        for c in args.logit_configs}
    logit["tile loop"] = max_logit
    for name, fn in logit.items():
      ms = time_jax(jax.jit(functools.partial(fn, scale=scale, causal=True)), (q, k, ids),
                    reps=args.reps)
      print(json.dumps({**row, "max_logit": name, "ms": round(ms, 3),
                        "tflops": round(logit_flops / ms / 1e9, 1)}), flush=True)


if __name__ == "__main__":
  main()

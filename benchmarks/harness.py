"""What the benchmark scripts share: timing JAX functions and fla's Torch ones, the relative
error of a result, and writing a markdown table. benchmarks/ is not a package: a script
imports this as `harness` (its folder is on sys.path when it runs)."""

from __future__ import annotations

import datetime
import time

import jax
import numpy as np


def header(*details: str) -> str:
  """"# <date>, <device>, JAX <version>; <details>": a benchmark's first line."""
  run = (f"# {datetime.date.today().isoformat()}, {jax.devices()[0].device_kind}, "
         f"JAX {jax.__version__}")
  return "; ".join((run, *details))


def time_jax(fn, args, reps=20):
  """Median of 5 groups of `reps` back-to-back calls fn(*args), in ms, after a first call:
  no wait between the calls of a group, as a step runs its kernels."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps * 1e3)
  return float(np.median(times))


def time_torch(fwd, fwd_bwd, reps, grad_to_none):
  """{"fwd_ms", "fwd_bwd_ms"}: Triton's `do_bench` medians of fwd (without autograd) and
  fwd_bwd (the leaves' grads in grad_to_none reset between calls), over a span that grows
  with reps as `time_jax`'s does."""
  import torch  # noqa: PLC0415
  import triton  # noqa: PLC0415
  with torch.no_grad():
    fwd_ms = triton.testing.do_bench(fwd, warmup=25, rep=100 * reps // 20,
                                     return_mode="median")
  fwd_bwd_ms = triton.testing.do_bench(fwd_bwd, warmup=25, rep=200 * reps // 20,
                                       grad_to_none=grad_to_none, return_mode="median")
  return dict(fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms)


def paired(a, b) -> tuple[float, float, float, float, float]:
  """Times of two builds taken in alternation (a[i] just before b[i]): (median a, median b,
  then the median, min and max of b[i] - a[i]). Pairs cancel the drift both builds saw."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or not a.size:
    raise ValueError(f"paired times need two equal, non-empty lists: {a.size} and {b.size}")
  diff = b - a
  return (float(np.median(a)), float(np.median(b)), float(np.median(diff)),
          float(diff.min()), float(diff.max()))


def rel_rms(a, b):
  """||a - b|| / ||b|| in float64 (||a - b|| where b is all zeros)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


def write_table(lines, out=None):
  """Prints the markdown table `lines` after a blank line and, given a path `out`, writes
  it there too."""
  table = "\n".join(lines)
  print("\n" + table)
  if out:
    with open(out, "w") as f:
      f.write(table + "\n")

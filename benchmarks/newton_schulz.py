"""Newton-Schulz (5 quintic steps, bf16) on one GPU: our kernel vs plain XLA vs optax.

For each batch x (m x n): random bf16 blocks (timed calls rotate through input sets whose
total exceeds the L2 cache), median time of each path, the rate of the standard
form's FLOPs (the ANCHORS convention), the bandwidth of one read and one write of x (the
least traffic any path can have), and each path's relative Frobenius error against the
float32 reference (`newton_schulz_reference`) on the same bf16 input.

Paths, by `newton_schulz` backend: "auto" (what it picks), "reference" (the standard form in
bf16, as optax runs it; each matmul accumulates in float32), "gram_reference" (the Gram form
in plain XLA); "optax" (`optax.contrib`'s `orthogonalize_via_newton_schulz`, the head axis a
batch axis), "symmetric" (the standard form's symmetric products on Mosaic GPU, for blocks
whose short side is a multiple of 256) and, with --variants, tuning variants of the GPU
kernel. For short-wide blocks "auto" is our kernel; for the others it is "reference".

Run on the H200 (--check first compares the forced kernel with the reference on odd shapes,
float32 and bf16; --variants adds kernel tuning variants for the per-head shape):
    python3 benchmarks/newton_schulz.py --check --out $OUT/newton_schulz.md
"""

from __future__ import annotations

import argparse
import datetime
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness import write_table
from pallas_kernels.newton_schulz import (COEFFS, newton_schulz, newton_schulz_gpu,
                                          newton_schulz_reference, symmetric, uses_gram_kernel)

SHAPES = ((96, 128, 7168), (256, 1024, 768), (64, 1536, 2048), (1, 4096, 16384))
L2_BYTES = 50 * 2**20
COPY_TBPS = 4.27  # ANCHORS: measured elementwise read + write on the H200


def optax_ns(x):
  from optax import contrib  # noqa: PLC0415
  dims = contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)  # axis 0: batch
  return contrib._muon.orthogonalize_via_newton_schulz(x, jnp.asarray(COEFFS), 5, eps=1e-7,
                                                       dimension_numbers=dims)


def paths(shape, variants):
  """name -> function of x [B, m, n]."""
  out = {
      "reference": functools.partial(newton_schulz, backend="reference"),
      "auto": functools.partial(newton_schulz, backend="auto"),
      "optax": optax_ns,
  }
  if symmetric.fits(shape, jnp.bfloat16):
    out["symmetric"] = functools.partial(newton_schulz, backend="symmetric")
  if min(shape[1:]) <= 128:  # (for the others the Gram form in XLA is the slower one)
    out["gram_reference"] = functools.partial(newton_schulz, backend="gram_reference")
    if variants:
      whole = dict(iterate="whole")
      for name, kw in {
          "gpu iterate=whole tf32": dict(whole, iterate_precision=jax.lax.Precision.DEFAULT),
          "gpu iterate=whole bf16x3": dict(whole, iterate_precision="bf16x3"),
          "gpu iterate=whole fp16": dict(whole, iterate_precision="fp16"),
          "gpu iterate=whole fp16 tn128": dict(whole, iterate_precision="fp16", tile_n=128),
          "gpu iterate=kernel fp16": dict(iterate="kernel", iterate_precision="fp16"),
      }.items():
        out[name] = functools.partial(newton_schulz_gpu, **kw)
  return out


def flops(B, m, n):
  """Standard-form FLOPs of 5 steps: X X^T, A A and (bA + cAA) X per step."""
  m, n = min(m, n), max(m, n)
  return 5 * B * (4 * m * m * n + 2 * m ** 3)


def rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def time_ms(fn, inputs):
  """Median over 7 groups of back-to-back calls (inputs rotated; ~30 ms per group), in ms."""
  jax.block_until_ready(fn(inputs[0]))
  t = time.perf_counter()
  jax.block_until_ready(fn(inputs[1]))
  reps = int(np.clip(0.03 / (time.perf_counter() - t), 3, 300))
  times = []
  for _ in range(7):
    t = time.perf_counter()
    for i in range(reps):
      y = fn(inputs[i % len(inputs)])
    jax.block_until_ready(y)
    times.append((time.perf_counter() - t) / reps * 1e3)
  return float(np.median(times)), float(np.min(times)), float(np.max(times))


def check_kernel():
  """The forced kernel vs the reference on awkward shapes, on this device (float32 and bf16;
  ragged batch counts, m > n, n off the tile); prints the worst errors and returns True if
  every one is under the tests' tolerances (1e-5 float32, 1e-2 bf16)."""
  ok = True
  fns = {"kernel": functools.partial(newton_schulz, backend="kernel")}
  if jax.default_backend() == "gpu":
    fns["whole"] = functools.partial(newton_schulz_gpu, iterate="whole")
  for shape in ((3, 128, 7168), (5, 40, 300), (2, 2, 700, 64), (7, 16, 1000)):
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
      x = jax.random.normal(jax.random.key(len(shape) + shape[-1]), shape, dtype)
      ref = newton_schulz_reference(x)
      for name, f in fns.items():
        if name != "kernel" and dtype == jnp.float32:
          continue  # forced Triton iteration in float32: IEEE dots, minutes of compile
        out = jax.jit(f)(x)
        err = rel(out, ref)
        finite = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        ok &= err < tol and finite and out.shape == x.shape and out.dtype == x.dtype
        print(f"check {name} {shape} {jnp.dtype(dtype).name}: err {err:.2e} (tol {tol:.0e}), "
              f"finite {finite}", flush=True)
  return ok


def spectrum_inputs(B, m, n, seed=0):
  """name -> bf16 [B, m, n] blocks with a chosen spectrum (per block: random singular vectors).

  Momentum matrices are far from Gaussian: their singular values spread over orders of
  magnitude (low stable rank), and the Gram matrix squares that spread. "gauss": i.i.d.
  normal; "cond 1e2" / "cond 1e4": singular values log-spaced over 2 / 4 decades;
  "rank 4 + 1e-3": a rank-4 matrix plus 1e-3 noise.
  """
  rng = np.random.default_rng(seed)
  out = {"gauss": rng.standard_normal((B, m, n))}
  for cond in (1e2, 1e4):
    blocks = []
    for _ in range(B):
      u, _ = np.linalg.qr(rng.standard_normal((m, m)))
      v, _ = np.linalg.qr(rng.standard_normal((n, m)))
      blocks.append((u * np.logspace(0, -np.log10(cond), m)) @ v.T)
    out[f"cond {cond:.0e}"] = np.stack(blocks)
  out["rank 4 + 1e-3"] = (rng.standard_normal((B, m, 4)) @ rng.standard_normal((B, 4, n))
                          + 1e-3 * rng.standard_normal((B, m, n)))
  return {k: jnp.asarray(v, jnp.bfloat16) for k, v in out.items()}


def spectrum_errors(shape, variants):
  """Each path's relative error against the float32 reference on inputs of several spectra;
  returns the markdown lines."""
  B, m, n = shape
  inputs = spectrum_inputs(B, m, n)
  lines = ["", f"Relative error vs the float32 reference, {B} x ({m} x {n}) bf16 blocks of "
           "several spectra (`spectrum_inputs`):", "",
           "| path | " + " | ".join(inputs) + " |", "|---|" + "---|" * len(inputs)]
  refs = {k: jax.jit(newton_schulz_reference)(x) for k, x in inputs.items()}
  for name, f in paths(shape, variants).items():
    fn = jax.jit(f)
    try:
      errs = [f"{rel(fn(x), refs[k]):.1e}" for k, x in inputs.items()]
    except Exception as e:  # noqa: BLE001
      errs = [f"failed: {type(e).__name__}"] * len(inputs)
    lines.append(f"| {name} | " + " | ".join(errs) + " |")
    print(lines[-1], flush=True)
  return lines


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
  ap.add_argument("--variants", action="store_true", help="also time GPU kernel variants")
  ap.add_argument("--only", nargs="*", help="time only these paths")
  ap.add_argument("--out", help="also write the markdown table here")
  ap.add_argument("--check", action="store_true", help="first check the kernel on odd shapes")
  ap.add_argument("--spectra", action="store_true",
                  help="also the errors of every path on 16 x (128 x 7168) blocks of several "
                  "spectra")
  args = ap.parse_args()
  if args.check:
    print("kernel checks passed" if check_kernel() else "KERNEL CHECKS FAILED", flush=True)

  dev = jax.devices()[0]
  lines = [f"Newton-Schulz, 5 steps, bf16 in/out; {datetime.date.today()}, {dev.device_kind}, "
           f"jax {jax.__version__}. Median of 7 groups of back-to-back calls over rotated "
           "inputs. TFLOP/s: standard-form FLOPs / time; GB/s: (read x + write x) / time. "
           "err: relative Frobenius error vs the float32 reference on the same input.", "",
           "| batch x (m x n) | path | median ms (min-max) | vs reference | TFLOP/s | GB/s | err |",
           "|---|---|---|---|---|---|---|"]
  for spec in args.shapes:
    B, m, n = map(int, spec.split(","))
    nbytes = B * m * n * 2
    sets = max(2, -(-2 * L2_BYTES // nbytes))
    keys = jax.random.split(jax.random.key(0), sets)
    inputs = [jax.random.normal(k, (B, m, n), jnp.bfloat16) for k in keys]
    ref = jax.jit(newton_schulz_reference)(inputs[0])
    fns = paths((B, m, n), args.variants)
    base = None
    print(f"# {B} x ({m} x {n}): auto uses the Gram kernel: {uses_gram_kernel((m, n))}; "
          f"copy floor (read + write) {2 * nbytes / COPY_TBPS / 1e9:.3f} ms", flush=True)
    for name, f in fns.items():
      if args.only and name not in args.only:
        continue
      fn = jax.jit(f)
      try:
        err = rel(fn(inputs[0]), ref)
        med, lo, hi = time_ms(fn, inputs)
      except Exception as e:  # noqa: BLE001  (report a failing path, time the others)
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        lines.append(f"| {B} x ({m} x {n}) | {name} | failed: {type(e).__name__} | | | | |")
        continue
      if name == "reference":
        base = med
      speed = f"{base / med:.2f}x" if base else ""
      row = (f"| {B} x ({m} x {n}) | {name} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {speed} | "
             f"{flops(B, m, n) / med / 1e9:.0f} | {2 * nbytes / med / 1e6:.0f} | {err:.1e} |")
      print(row, flush=True)
      lines.append(row)
    del inputs, ref
  if args.spectra:
    lines += spectrum_errors((16, 128, 7168), args.variants)
  write_table(lines, args.out)


if __name__ == "__main__":
  main()

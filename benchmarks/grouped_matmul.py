"""Grouped matmul on one GPU: the Mosaic GPU kernel against XLA's `ragged_dot` and against the
capacity layout's batched einsum (the dense rate of the same rows), at a MoE's shapes.

    python benchmarks/grouped_matmul.py                       # k3_small's experts
    python benchmarks/grouped_matmul.py --sweep=gmm,gmm^T,tgmm  # tile sizes, per product
    python benchmarks/grouped_matmul.py --rows 65536 --k 1024 --n 768 --groups 64

One product [M, K] x [G, K, N] (rows sorted by group, bf16), forward and forward+backward
(the VJP of a bf16 cotangent: dlhs and the weight gradient, two more grouped products), on
balanced groups (M / G rows each, as the capacity layout's buffers at factor 1.0) and on
random ones (each row's group drawn uniformly). Each row: median times and TFLOP/s (2 M K N
a product; fwd+bwd 3x) against ANCHORS.md's 669 TFLOP/s batched-einsum ceiling; the
forward's relative RMS error against the exact product (float64 on the host); agreement with
`ragged_dot` (relative RMS of out, dlhs, drhs). `--sweep`: each product of the kernel over
tile sizes (balanced groups).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness import rel_rms, time_jax
from pallas_kernels.grouped_matmul import grouped_matmul, kernel, kernel_ws

CEILING_TFLOPS = 669.0  # ANCHORS.md: batched einsum [E, C, K] x [E, K, N], fwd+bwd, H200


def library_gmm(lhs, rhs, sizes, transpose_rhs=False):
  """JAX's library kernel `ragged_dot_mgpu` (its group search unrolled over G), our tiles."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415
  return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, transpose_rhs=transpose_rhs,
                                    **dataclasses.asdict(kernel.BLOCKS))


@jax.custom_vjp
def library(lhs, rhs, sizes):
  """The kernel backend's products with the library's gmm (and gmm^T) for ours."""
  return library_gmm(lhs, rhs, sizes)


library.defvjp(lambda a, b, s: (library_gmm(a, b, s), (a, b, s)),
               lambda res, d: (library_gmm(d.astype(res[0].dtype), res[1], res[2], True),
                               kernel.tgmm(res[0], d.astype(res[0].dtype), res[2]), None))


def implementations(G):
  """name -> f(lhs, rhs, sizes) -> [M, N]."""
  def capacity(lhs, rhs, sizes):  # balanced groups only: [G, M / G, K] x [G, K, N]
    del sizes
    out = jnp.einsum("gck,gkn->gcn", lhs.reshape(G, -1, lhs.shape[1]), rhs)
    return out.reshape(lhs.shape[0], -1)
  return {"kernel": lambda a, b, s: grouped_matmul(a, b, s, backend="kernel"),
          "kernel warp-specialized": lambda a, b, s: grouped_matmul(a, b, s,
                                                                    backend="kernel_ws"),
          "library ragged_dot_mgpu": library,
          "xla ragged_dot": lambda a, b, s: grouped_matmul(a, b, s, backend="reference"),
          "capacity einsum": capacity}


def exact_product(lhs, rhs, sizes):
  """The per-group product in float64 (numpy, on the host): [M, N]."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  exact = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    exact[start:start + size] = lhs[start:start + size] @ rhs[g]
    start += size
  return exact


def fwd_and_bwd(f):
  """The jitted forward, and forward + backward fb(lhs, rhs, sizes, dout): the VJP of the
  cotangent dout, in the output's dtype as a layer's backward receives it, to lhs and rhs."""
  def fb(lhs, rhs, sizes, dout):
    out, pull = jax.vjp(lambda a, b: f(a, b, sizes), lhs, rhs)
    return out, pull(dout)
  return jax.jit(f), jax.jit(fb)


def problem(seed, M, K, N, G, balanced):
  rng = np.random.default_rng(seed)
  if balanced:
    sizes = np.full(G, M // G)
  else:
    sizes = np.bincount(rng.integers(0, G, M), minlength=G)
  lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
  return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout


def compare(M, K, N, G, reps, impls):
  """Prints a row per implementation (those whose name's first word is in impls) on
  balanced, then on random groups."""
  for balanced in (True, False):
    lhs, rhs, sizes, dout = problem(0, M, K, N, G, balanced)
    label = "balanced" if balanced else "random"
    results = {}
    for name, f in implementations(G).items():
      if (name == "capacity einsum" and not balanced) or name.split()[0] not in impls:
        continue
      fwd, fb = fwd_and_bwd(f)
      try:
        t0 = time.perf_counter()
        fb = fb.lower(lhs, rhs, sizes, dout).compile()
        compile_s = time.perf_counter() - t0
        out = fwd(lhs, rhs, sizes)
        _, grads = fb(lhs, rhs, sizes, dout)
        results[name] = (out, *grads, time_jax(fwd, (lhs, rhs, sizes), reps),
                         time_jax(fb, (lhs, rhs, sizes, dout), reps), compile_s)
      except Exception as e:  # noqa: BLE001 -- report and go on with the others
        print(f"{label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    ref = results.get("xla ragged_dot")
    exact = exact_product(lhs, rhs, sizes)
    flop = 2 * M * K * N
    for name, (out, dlhs, drhs, f_ms, fb_ms, compile_s) in results.items():
      agree = ""
      if ref is not None and name != "xla ragged_dot":
        agree = ", ".join(
            f"{n} {rel_rms(a, b):.1e}" for n, a, b in
            (("out", out, ref[0]), ("dlhs", dlhs, ref[1]), ("drhs", drhs, ref[2])))
      print(f"| {label} | {name} | {f_ms:.3f} | {fb_ms:.3f} | {flop / f_ms / 1e9:.0f} | "
            f"{3 * flop / fb_ms / 1e9:.0f} | {3 * flop / fb_ms / 1e9 / CEILING_TFLOPS:.0%} | "
            f"{rel_rms(out, exact):.2e} | {agree} | {compile_s:.1f} |", flush=True)


def sweep(M, K, N, G, reps, products, chosen_only=False):
  """Times of each product of the kernel over tile sizes (balanced groups); chosen_only: at
  the chosen tiles alone (`kernel.BLOCKS`, `kernel_ws.WS_BLOCKS`), against the same product
  as a batched einsum (which product the fwd+bwd time goes to)."""
  lhs, rhs, sizes, dout = problem(0, M, K, N, G, True)
  candidates = {
      "gmm": (lambda b: jax.jit(lambda a, w, s: kernel.gmm(a, w, s, blocks=b)),
              (lhs, rhs, sizes)),
      "gmm^T": (lambda b: jax.jit(lambda a, w, s: kernel.gmm(a, w, s, transpose_rhs=True,
                                                             blocks=b)),
                (dout, rhs, sizes)),
      "tgmm": (lambda b: jax.jit(lambda a, d, s: kernel.tgmm(a, d, s, blocks=b)),
               (lhs, dout, sizes)),
      "gmm_ws": (lambda b: jax.jit(lambda a, w, s: kernel_ws.gmm_ws(a, w, s, blocks=b)),
                 (lhs, rhs, sizes)),
      "gmm_ws^T": (lambda b: jax.jit(lambda a, w, s: kernel_ws.gmm_ws(a, w, s, True, blocks=b)),
                   (dout, rhs, sizes)),
      "tgmm_ws": (lambda b: jax.jit(lambda a, d, s: kernel_ws.tgmm_ws(a, d, s, blocks=b)),
                  (lhs, dout, sizes)),
      # the same two with the transposed operand made by XLA first (timed with it), not
      # read through a transposed view in the kernel
      "gmm_ws^T_xla": (lambda b: jax.jit(lambda a, w, s: kernel_ws.gmm_ws(
          a, jnp.swapaxes(w, 1, 2), s, blocks=b)), (dout, rhs, sizes)),
      "tgmm_ws_xla": (lambda b: jax.jit(lambda a, d, s: kernel_ws.tgmm_ws(
          a.T, d, s, blocks=b, lhs_transposed=True)), (lhs, dout, sizes))}
  # the same product as a batched einsum over balanced groups (the dense rate to reach)
  dense = {"gmm": ("gck,gkn->gcn", lhs.reshape(G, -1, K), rhs),
           "gmm^T": ("gcn,gkn->gck", dout.reshape(G, -1, N), rhs),
           "tgmm": ("gck,gcn->gkn", lhs.reshape(G, -1, K), dout.reshape(G, -1, N))}
  flop = 2 * M * K * N
  for name in products:
    if chosen_only:
      spec, a, b = dense[name.replace("_ws", "").replace("_xla", "")]
      ms = time_jax(jax.jit(functools.partial(jnp.einsum, spec)), (a, b), reps)
      print(f"  {name} as a batched einsum: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s",
            flush=True)
    make, args = candidates[name]
    best = None
    if "_ws" in name:  # block_n is each compute warpgroup's, a CTA's tile 2 block_n wide
      tiles = [kernel_ws.WS_BLOCKS] if chosen_only else [
          kernel_ws.WSBlocks(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                          grid_block_n=gbn, epi_n=epi, chain=chain)
          for bm, bn, steps, gbn, epi, chain in itertools.product(
              (64, 128), (128, 192), (2, 3, 4), (4,), (64,), (True, False))
          if bn % epi == 0 and (chain or not name.startswith("tgmm"))]
    else:
      tiles = [kernel.BLOCKS] if chosen_only else [
          kernel.Blocks(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                        grid_block_n=gbn)
          for bm, bn, steps, gbn in itertools.product((64, 128, 192), (64, 128, 256),
                                                      (2, 4, 6), (1, 4))]
    for blocks in tiles:
      try:
        ms = time_jax(make(blocks), args, reps)
      except Exception as e:  # noqa: BLE001 -- a tile the shapes or shared memory refuse
        first_line = (str(e).splitlines() or [""])[0]
        print(f"  {name} {blocks}: {type(e).__name__}: {first_line[:120]}")
        continue
      print(f"  {name} {dataclasses.astuple(blocks)}: {ms:.3f} ms, "
            f"{flop / ms / 1e9:.0f} TFLOP/s", flush=True)
      if best is None or ms < best[0]:
        best = (ms, blocks)
    print(f"{name}: best {best}", flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rows", type=int, default=2 * 4096 * 8, help="M: k3_small's microbatch of "
                 "2 x 4096 tokens, top-8")
  p.add_argument("--k", type=int, default=1024, help="K (k3_small: latent 1024)")
  p.add_argument("--n", type=int, default=768, help="N (k3_small: expert hidden 768)")
  p.add_argument("--groups", type=int, default=64)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--impls", default="kernel,library,xla,capacity",
                 help="implementations to compare, by the first word of their name")
  p.add_argument("--sweep", default="", help="products to sweep tiles of, from gmm,gmm^T,"
                 "tgmm, the warp-specialized gmm_ws,gmm_ws^T,tgmm_ws, and gmm_ws^T_xla,"
                 "tgmm_ws_xla (the transposed operand made by XLA first)")
  p.add_argument("--chosen_only", action="store_true",
                 help="--sweep at the chosen tiles alone (kernel.BLOCKS, "
                 "kernel_ws.WS_BLOCKS): each product's time against its batched einsum")
  a = p.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; M {a.rows}, K {a.k}, "
        f"N {a.n}, G {a.groups}, bf16", flush=True)
  if a.sweep:
    sweep(a.rows, a.k, a.n, a.groups, a.reps, a.sweep.split(","), a.chosen_only)
    return
  print("| groups | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | of 669 | "
        "out vs exact | vs ragged_dot | fwd+bwd compile s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  compare(a.rows, a.k, a.n, a.groups, a.reps, a.impls.split(","))


if __name__ == "__main__":
  main()

"""KDA's short convolution on one GPU: our kernels, the plain-JAX reference (XLA) and fla's
Triton `causal_conv1d` (+ its `l2norm` for q and k) on the same inputs.

Per shape (B, T, H, D) and per form (q/k: conv, SiLU, L2 norm over D; v: conv, SiLU): bf16
activations packed with two documents a row (fla gets the same rows flattened with
cu_seqlens), fp32 taps as the model holds them. Prints the agreement of y, dx and dw with
the fp32 reference (relative RMS) and median times of the forward and forward+backward,
with GB/s on the least traffic a fused form needs (forward: read x, write y; backward: read
x and dy, write dx: 10 bytes an element in all, bf16).

Run on the H200 (fla carried as wheels, see /work/shared/ANCHORS.md):
    python3 benchmarks/short_conv.py --shapes 8,4096,16,128 2,4096,16,128 --peer fla
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from harness import rel_rms, time_jax, time_torch
from pallas_kernels.short_conv import short_conv_pallas, short_conv_reference

W = 4  # k3's conv_size


def make_inputs(seed, B, T, H, D):
  """numpy float32 x, dy [B, T, H, D] (bf16 values: every form, the fp32 reference too,
  sees the same inputs), taps w [W, H, D] and segment ids [B, T] (two documents a row, cut
  at T / 3)."""
  rng = np.random.default_rng(seed)
  seg = np.repeat([[1, 2]], [T // 3, T - T // 3], axis=1).repeat(B, 0).astype(np.int32)
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
  return dict(x=bf16(rng.standard_normal((B, T, H, D), dtype=np.float32)),
              dy=bf16(rng.standard_normal((B, T, H, D), dtype=np.float32)),
              w=rng.uniform(-0.5, 0.5, (W, H, D)).astype(np.float32), seg=seg)


def jax_fns(fn, normalize):
  def fwd(x, w, seg):
    return fn(x, w, seg, normalize=normalize)

  def fwd_bwd(x, w, seg, dy):
    y, vjp = jax.vjp(lambda x, w: fwd(x, w, seg), x, w)
    return (y,) + vjp(dy)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def run_jax(inp, fn, normalize, reps, dtype=jnp.bfloat16):
  x, dy = jnp.asarray(inp["x"], dtype), jnp.asarray(inp["dy"], dtype)
  w, seg = jnp.asarray(inp["w"]), jnp.asarray(inp["seg"])
  fwd, fwd_bwd = jax_fns(fn, normalize)
  y, dx, dw = fwd_bwd(x, w, seg, dy)
  res = {n: np.asarray(jnp.asarray(a, jnp.float32)) for n, a in zip(("y", "dx", "dw"),
                                                                    (y, dx, dw))}
  res["fwd_ms"] = time_jax(fwd, (x, w, seg), reps)
  res["fwd_bwd_ms"] = time_jax(fwd_bwd, (x, w, seg, dy), reps)
  return res


def run_fla(inp, normalize, reps):
  """fla's causal_conv1d with SiLU (and l2norm per head): x flattened to one row of B T
  tokens cut into the documents by cu_seqlens; its weight [H D, W] holds our tap j in
  column W - 1 - j."""
  import torch  # noqa: PLC0415
  from fla.modules.causal_conv1d import causal_conv1d  # noqa: PLC0415
  from fla.modules.norm.l2norm import l2norm  # noqa: PLC0415
  B, T, H, D = inp["x"].shape
  dev = "cuda"
  x = torch.tensor(inp["x"].reshape(1, B * T, H * D), device=dev).bfloat16().requires_grad_()
  dy = torch.tensor(inp["dy"].reshape(1, B * T, H * D), device=dev).bfloat16()
  w = torch.tensor(inp["w"][::-1].reshape(W, H * D).T.copy(), device=dev).requires_grad_()
  seg = inp["seg"].reshape(-1)
  cuts = np.flatnonzero(np.diff(seg) != 0) + 1
  rows = np.arange(1, B) * T
  bounds = np.unique(np.concatenate([[0], cuts, rows, [B * T]]))
  cu = torch.tensor(bounds, device=dev, dtype=torch.int32)

  def fwd():
    y, _ = causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
    if normalize:
      y = l2norm(y.view(1, B * T, H, D)).view(1, B * T, H * D)
    return y

  def fwd_bwd():
    y = fwd()
    y.backward(dy)
    return y

  x.grad = w.grad = None
  y = fwd_bwd()
  res = dict(y=y.float().view(B, T, H, D), dx=x.grad.float().view(B, T, H, D),
             dw=w.grad.float().T.reshape(W, H, D).flip(0))
  res = {n: a.detach().cpu().numpy() for n, a in res.items()}
  return res | time_torch(fwd, fwd_bwd, reps, grad_to_none=[x, w])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", nargs="+", default=["8,4096,16,128"])
  p.add_argument("--blocks", default="16,16:fp32",
                 help="our kernels' rows per program, ':fp32' after one: dp stored in fp32")
  p.add_argument("--peer", default="fla", choices=["fla", "none"])
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU)")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  a = p.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  table = []
  for shape in a.shapes:
    B, T, H, D = map(int, shape.split(","))
    inp = make_inputs(0, B, T, H, D)
    gb = 10 * B * T * H * D / 1e9
    for normalize in (True, False):
      form = "q/k (L2 norm)" if normalize else "v"
      exact = run_jax(inp, short_conv_reference, normalize, 1, dtype=jnp.float32)
      runs = {"reference": lambda: run_jax(inp, short_conv_reference, normalize, a.reps)}
      for spec in a.blocks.split(","):
        bt, _, dp = spec.partition(":")
        if dp not in ("", "fp32"):
          raise SystemExit(f"--blocks {spec!r}: after ':' only 'fp32' (dp stored in fp32)")
        fn = functools.partial(short_conv_pallas, block_t=int(bt), interpret=a.interpret,
                               dp_dtype="float32" if dp == "fp32" else None)
        runs[f"ours bt{spec}"] = lambda fn=fn: run_jax(inp, fn, normalize, a.reps)
      if a.peer == "fla":
        runs["fla"] = lambda: run_fla(inp, normalize, a.reps)
      for name, run in runs.items():
        r = run()
        err = {n: rel_rms(r[n], exact[n]) for n in ("y", "dx", "dw")}
        row = dict(shape=shape, form=form, impl=name, fwd_ms=r["fwd_ms"],
                   fwd_bwd_ms=r["fwd_bwd_ms"], gbps=gb / r["fwd_bwd_ms"] * 1e3, **err)
        table.append(row)
        print(f"{shape} {form:14s} {name:9s} fwd {r['fwd_ms']:.3f} ms  fwd+bwd "
              f"{r['fwd_bwd_ms']:.3f} ms ({row['gbps']:.0f} GB/s)  err y {err['y']:.1e} "
              f"dx {err['dx']:.1e} dw {err['dw']:.1e}", flush=True)
  with open(os.path.join(a.out, "short_conv_bench.json"), "w") as f:
    json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=table), f,
              indent=1)


if __name__ == "__main__":
  main()

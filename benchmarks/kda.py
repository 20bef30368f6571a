"""KDA on one GPU: our Pallas kernels against fla's Triton `chunk_kda` on the same inputs.

For each shape (B, T, H, D): bf16 q, k (unit norm), v, g in (-5, 0) (the bounded gate, already
applied), beta in (0, 1), an fp32 initial state. Prints, per shape, the agreement of outputs,
final states and all six gradients (relative RMS; ours vs fla, and each vs the fp32
chunked reference where it fits), and median times of forward and forward+backward with
TFLOP/s of the chunked algorithm's matmuls (same count for both).

fla autotunes its Triton kernels on every new shape: over 200 s for the first shape here
(2026-11-30), so give a call several minutes per shape. Run on the H200 (fla carried as
wheels, see /work/shared/ANCHORS.md):
    python3 benchmarks/kda.py --shapes 8,4096,16,128 1,32768,16,128 --peer fla
    python3 benchmarks/kda.py --shapes 1,32768,16,128 --variants s1,s4,s8 --peer none
    python3 benchmarks/kda.py --breakdown --shapes 1,32768,16,128 --rec w4:bv64:s8 \
        --spans w4:bv64:s8,w4:bv32:s8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness import rel_rms, time_jax, time_torch
from pallas_kernels.kda import kda_chunk, kda_pallas

TOL = {"o": 0.005, "state": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008,
       "dg": 0.02, "dbeta": 0.02}  # fla's bf16 conventions (relative RMS)
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# --variants: name -> kda_pallas keywords
VARIANTS = {"save": dict(save_states=True), "recompute": dict(save_states=False),
            "bv16": dict(block_v=16), "bv32": dict(block_v=32), "bv128": dict(block_v=128),
            "c16": dict(chunk_size=16), "c32": dict(chunk_size=32),
            "w4": dict(bwd_warps=4), "w16": dict(bwd_warps=16),
            "bwdtf32": dict(bwd_precision="tf32"), "bwdtf32x3": dict(bwd_precision="tf32x3"),
            "preptf32": dict(prep_precision="tf32"),
            "preptf32x3": dict(prep_precision="tf32x3"),
            "nost": dict(states_block_v=0, states_warps=0),
            "softplus": dict(bounded_gate=False), "noinv": dict(save_inverse=False),
            **{f"s{n}": dict(spans=n) for n in (1, 2, 4, 8, 16, 32, 64)}}


def make_inputs(seed, B, T, H, D):
  """numpy float32 arrays: q, k, v, g, beta, h0 and the cotangents do, dht."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s, dtype=np.float32)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(f(B, T, H, D)), unit(f(B, T, H, D))
  g = (-5.0 / (1.0 + np.exp(-f(B, T, H, D) - 2.0))).astype(np.float32)  # mean ~ -4.4
  beta = (1.0 / (1.0 + np.exp(-f(B, T, H)))).astype(np.float32)
  return dict(q=q, k=k, v=f(B, T, H, D), g=g, beta=beta, h0=0.1 * f(B, H, D, D),
              do=f(B, T, H, D), dht=0.1 * f(B, H, D, D))


def flops(B, T, H, D, C=64):
  """Forward matmul FLOPs of the chunked form (scores, UT products, recurrence); the
  backward is counted as twice that."""
  per_chunk = 4 * C * C * D + 2 * C * C * 2 * D + 2 * C * C * D + 6 * C * D * D
  return B * H * (T // C) * per_chunk


def jax_fns(impl):
  """jitted forward and forward+backward (cotangents do, dht) of one implementation."""
  def fwd(q, k, v, g, beta, h0):
    return impl(q, k, v, g, beta, initial_state=h0, output_final_state=True)

  def fwd_bwd(q, k, v, g, beta, h0, do, dht):
    out, vjp = jax.vjp(fwd, q, k, v, g, beta, h0)
    return out, vjp((do.astype(out[0].dtype), dht))

  return jax.jit(fwd), jax.jit(fwd_bwd)


def run_ours(x, variants, reps, impl=kda_pallas, gate_dtype="bfloat16", profile=None):
  """Outputs, gradients and times per variant; profile: a folder for a trace of each
  variant's forward and forward+backward, whose costliest device ops are printed."""
  bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
  args = [bf(n) for n in ("q", "k", "v")] + [jnp.asarray(x["g"], gate_dtype), bf("beta"),
                                               jnp.asarray(x["h0"])]
  cots = [bf("do"), jnp.asarray(x["dht"])]
  results = {}
  for name, kw in variants.items():
    fwd, fwd_bwd = jax_fns(functools.partial(impl, **kw))
    _, grads = fwd_bwd(*args, *cots)
    o, st = fwd(*args)  # the forward alone: the path a forward-only call takes
    res = dict(zip(NAMES, [o, st, *grads]))
    res = {n: np.asarray(jnp.asarray(a, jnp.float32)) for n, a in res.items()}
    res["fwd_ms"] = time_jax(fwd, args, reps)
    res["fwd_bwd_ms"] = time_jax(fwd_bwd, args + cots, max(1, reps // 2))
    results[name] = res
    if profile:
      shape = "x".join(map(str, x["v"].shape))
      for what, fn, fn_args in (("fwd", fwd, args), ("fwd_bwd", fwd_bwd, args + cots)):
        print_costliest(os.path.join(profile, f"{shape}-{name}-{what}"), fn, fn_args,
                        f"{name} {what}")
  return results


def run_chunk_form(x, reps):
  """kda_chunk (pure JAX, chunk 32 as k3_small runs it) on the bf16 inputs, timed."""
  return run_ours(x, {"chunk": dict(chunk_size=32)}, reps, impl=kda_chunk)["chunk"]


def layer(B, T, reps, backends=("kernel:16", "reference:32"), profile=None):
  """k3_small's KDA layer (projections, short convs, norms, gates: `k3jax.model.kda.KDA`)
  forward+backward on [B, T, d] bf16 activations packed with two documents per row, per
  backend:chunk[:conv backend] (default conv backend "auto"); prints ms. profile: a folder
  for a trace of 3 steps per backend, whose costliest ops are printed."""
  import importlib.util  # noqa: PLC0415

  from flax import nnx  # noqa: PLC0415

  from k3jax.model.kda import KDA  # noqa: PLC0415
  spec = importlib.util.spec_from_file_location("k3_small", "experiments/k3_small.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = mod.get_config()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, cfg.model.d_model)), jnp.bfloat16)
  seg = jnp.asarray(np.repeat([[1, 2]], [T // 3, T - T // 3], axis=1).repeat(B, 0), jnp.int32)
  for item in backends:
    backend, chunk, *conv = item.split(":")
    cfg.model.kda.backend, cfg.model.kda.chunk_size = backend, int(chunk)
    cfg.model.kda.conv_backend = conv[0] if conv else "auto"
    model = KDA(cfg.model, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)

    def loss(p, x, graph=graph):
      y, _ = nnx.merge(graph, p)(x, seg)
      return jnp.sum(y.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    print(f"  KDA layer {item}: fwd+bwd {time_jax(step, (params, x), reps):.3f} ms", flush=True)
    if profile:
      print_costliest(os.path.join(profile, f"{B}x{T}-{item.replace(':', '-')}"), step,
                      (params, x), item)
  gate_cost(cfg, x, reps)


def gate_cost(cfg, x, reps):
  """What fusing the bounded gate into the kernels could save at most: forward+backward of
  the layer's decay (f_down, f_up, then g = lower_bound sigmoid(A (f + bias)) in fp32)
  against the two projections alone; the difference is the gate's own elementwise passes."""
  from flax import nnx  # noqa: PLC0415

  from k3jax.model.kda import KDA  # noqa: PLC0415
  graph, params = nnx.split(KDA(cfg.model, rngs=nnx.Rngs(0)))
  parts = {"decay (projections + gate)": lambda m, x: m.decay(x),
           "projections alone": lambda m, x: m.f_up(m.f_down(x))}
  for name, part in parts.items():
    def loss(p, x, part=part):
      return jnp.sum(part(nnx.merge(graph, p), x).astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    print(f"  {name}: fwd+bwd {time_jax(step, (params, x), reps):.3f} ms", flush=True)


def print_costliest(folder, fn, args, label, calls=3):
  """Traces `calls` calls of fn into folder and prints the costliest device ops per call."""
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    jax.block_until_ready([fn(*args) for _ in range(calls)])
  print(f"  costliest ops of {label}, ms per call:", flush=True)
  for name, ms, n in costliest_ops(folder):
    print(f"    {ms / calls:9.3f} ms  {n // calls:4d} x  {name[:110]}", flush=True)


def costliest_ops(folder, top=15):
  """(name, total ms, count) of the longest events of a `jax.profiler` perfetto trace under
  `folder`, device events (GPU kernels) if there are any, else all, longest first."""
  import glob  # noqa: PLC0415
  import gzip  # noqa: PLC0415
  path, = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  device = [e for e in spans if "/device:" in names.get(e["pid"], "")]
  totals = {}
  for e in device or spans:
    ms, n = totals.get(e["name"], (0.0, 0))
    totals[e["name"]] = (ms + e["dur"] / 1e3, n + 1)
  rows = sorted(((k, ms, n) for k, (ms, n) in totals.items()), key=lambda r: -r[1])
  return rows[:top]


def run_reference(x, gate_dtype="bfloat16"):
  """kda_chunk in fp32 on the inputs as the kernels get them (bf16-rounded, g in gate_dtype):
  the kernels' exact target."""
  up = lambda n, dt="bfloat16": jnp.asarray(jnp.asarray(x[n], dt), jnp.float32)
  args = [up(n) for n in ("q", "k", "v")] + [up("g", gate_dtype), up("beta"),
                                             jnp.asarray(x["h0"])]
  cots = [up("do"), jnp.asarray(x["dht"])]
  _, fwd_bwd = jax_fns(kda_chunk)
  (o, st), grads = fwd_bwd(*args, *cots)
  return {n: np.asarray(a) for n, a in zip(NAMES, [o, st, *grads])}


def run_fla(x, reps):
  import torch  # noqa: PLC0415
  from fla.ops.kda import chunk_kda  # noqa: PLC0415
  dev = "cuda"
  tb = lambda n: torch.tensor(x[n], device=dev).to(torch.bfloat16)
  q, k, v, g, beta = (tb(n).requires_grad_() for n in ("q", "k", "v", "g", "beta"))
  h0 = torch.tensor(x["h0"], device=dev).requires_grad_()
  do, dht = tb("do"), torch.tensor(x["dht"], device=dev)
  leaves = [q, k, v, g, beta, h0]

  def fwd():
    return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                     safe_gate=True, lower_bound=-5.0)

  def fwd_bwd():
    o, ht = fwd()
    torch.autograd.backward((o, ht), (do, dht))
    return o, ht

  for t in leaves:
    t.grad = None
  o, ht = fwd_bwd()
  res = dict(zip(NAMES, [o, ht] + [t.grad for t in leaves]))
  res = {n: a.detach().float().cpu().numpy() for n, a in res.items()}
  return res | time_torch(fwd, fwd_bwd, reps, grad_to_none=leaves)


def breakdown(shape, variants, rec_variants, cots_warps, bwd_variants, reps, interpret=False,
              chunk=None, gate_dtype="bfloat16", span_variants=()):
  """Times of the pieces at one shape: prep (per tuning in variants), rec_fwd and rec_bwd
  (per tuning in rec_variants), chunk_cots (per warp count in cots_warps), chunk_bwd (per
  tuning in bwd_variants) and the pieces of the spans' forward (per tuning in
  span_variants). gate_dtype: g's dtype ("float32" as the model's layer passes
  it). A piece that fails to compile prints its error and the others still run."""
  import dataclasses  # noqa: PLC0415
  from pallas_kernels.kda import blocks, chunk_kernels, recurrence, spans  # noqa: PLC0415
  from pallas_kernels.kda import pallas as P  # noqa: PLC0415
  B, T, H, D = shape
  x = make_inputs(0, B, T, H, D)
  bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
  cfg, args = P.kernel_inputs(*(bf(n) for n in ("q", "k", "v")),
                              jnp.asarray(x["g"], gate_dtype), bf("beta"), scale=None,
                              initial_state=jnp.asarray(x["h0"]), segment_ids=None,
                              chunk_size=chunk, sub_chunk_size=16, interpret=interpret,
                              platform=None, block_v=None, save_states=True)
  q, k, v, g, beta, st0, *masks = args
  Tp = blocks.dims(cfg, q)[2]

  def timed(name, fn, fn_args):
    try:
      print(f"  {name}: {time_jax(jax.jit(fn), fn_args, reps):.3f} ms", flush=True)
    except Exception as e:  # noqa: BLE001 -- report and go on to the next piece
      print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)

  for name, kw in variants.items():
    c = dataclasses.replace(cfg, **kw)
    timed(f"prep[{name}]", lambda *a, c=c: chunk_kernels.prep(c, *a), (q, k, v, g, beta, *masks))
  prep = jax.jit(lambda *a: chunk_kernels.prep(cfg, *a))(q, k, v, g, beta, *masks)
  do = jnp.asarray(x["do"], jnp.bfloat16)
  if blocks.heads_major(cfg.platform):
    do = do.swapaxes(1, 2)
  dst = jnp.swapaxes(jnp.asarray(x["dht"]), -1, -2)
  w, u, a, qs, ks, dec = rec = prep.recurrence
  for name, kw in rec_variants.items():
    c = dataclasses.replace(cfg, **kw)
    if Tp % (c.chunk * c.spans):
      print(f"  {name}: {c.spans} spans do not divide {Tp // c.chunk} chunks", flush=True)
      continue
    timed(f"recurrence fwd[{name}]",
          lambda *a, c=c: spans.forward(c, *a, jnp.bfloat16, True), (*rec, st0))
    timed(f"recurrence fwd[{name}, no states]",
          lambda *a, c=c: spans.forward(c, *a, jnp.bfloat16, False), (*rec, st0))
    t = jax.jit(lambda *a, c=c: spans.forward(c, *a, jnp.bfloat16, False)[3])(*rec, st0)
    timed(f"recurrence bwd[{name}]", lambda *a, c=c: spans.backward(c, *a),
          (w, a, qs, ks, dec, do, dst, t))
  for name, kw in span_variants.items():  # the spans' forward, piece by piece
    c = dataclasses.replace(cfg, **kw)
    timed(f"transitions[{name}]", lambda *a, c=c: spans.transitions(c, *a), (w, u, ks, dec))
    t = jax.jit(lambda *a, c=c: spans.transitions(c, *a))(w, u, ks, dec)
    timed(f"chain[{name}]", lambda *a, c=c: spans.chain(c, *a, reverse=False), (t, t, st0))
    entering = jax.jit(lambda *a, c=c: spans.chain(c, *a, reverse=False)[0])(t, t, st0)
    timed(f"rec_fwd from the spans' states[{name}, no states]",
          lambda *a, c=c: recurrence.rec_fwd(c, *a, jnp.bfloat16, False), (*rec, entering))
  _, _, states, t = jax.jit(lambda *a: spans.forward(cfg, *a, jnp.bfloat16, True))(*rec, st0)
  dvn, dstates, _ = jax.jit(lambda *a: spans.backward(cfg, *a))(w, a, qs, ks, dec, do, dst, t)
  for warps in cots_warps:
    c = dataclasses.replace(cfg, cots_warps=warps)
    timed(f"chunk_cots[w{warps}]", lambda *a, c=c: chunk_kernels.chunk_cots(c, *a),
          (w, u, states, dstates, do, dvn))
  dw, da, dqs, dks, ddec = jax.jit(lambda *a: chunk_kernels.chunk_cots(cfg, *a))(
      w, u, states, dstates, do, dvn)
  for name, kw in bwd_variants.items():
    c = dataclasses.replace(cfg, **kw)
    inverse = (jax.jit(lambda *a, c=c: chunk_kernels.prep(c, *a).inverse)(
        q, k, v, g, beta, *masks) if c.save_inverse else None)
    timed(f"chunk_bwd[{name}]", lambda *a, c=c, i=inverse: chunk_kernels.chunk_bwd(
        c, *a, inverse=i), (q, k, v, g, beta, *masks, dw, dvn, da, dqs, dks, ddec))


def parse_args():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", nargs="+", default=["8,4096,16,128"])
  p.add_argument("--peer", default="fla", choices=["fla", "none"])
  p.add_argument("--reference", action="store_true", help="also the fp32 chunked form")
  p.add_argument("--chunk_form", action="store_true",
                 help="also time the pure-JAX chunked form on the bf16 inputs (the model's "
                 "non-kernel backend)")
  p.add_argument("--variants", default="save",
                 help=f"comma list of {', '.join(VARIANTS)}; '+' combines (c16+recompute)")
  p.add_argument("--chunk", type=int, default=None,
                 help="chunk size of --breakdown (default: the platform's, 16 on GPU)")
  p.add_argument("--gate_dtype", default="bfloat16",
                 help="g's dtype for our kernels and the reference (float32 as the model's "
                      "layer passes it); fla always gets bf16")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  p.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU)")
  p.add_argument("--breakdown", action="store_true", help="time the pieces (GPU)")
  p.add_argument("--layer", action="store_true",
                 help="time k3_small's KDA layer, kernel vs chunk form (shapes: B,T)")
  p.add_argument("--layer_backends", default="kernel:16,reference:32",
                 help="with --layer: backend:chunk_size[:conv_backend] items to time")
  p.add_argument("--profile", default=None, help="trace our variants (or with --layer, the "
                 "layer) to this folder and print the costliest device ops")
  p.add_argument("--prep", default="w4:tf32,w4:tf32:noinv",
                 help="prep tunings for --breakdown: warps:prep_precision[:noinv] items")
  p.add_argument("--rec", default="w4:bv64,w4:bv32",
                 help="recurrence tunings for --breakdown: warps:block_v[:spans] items "
                      "(w2:bv32, w4:bv64:s16)")
  p.add_argument("--cots", default="4,8", help="chunk_cots warp counts for --breakdown")
  p.add_argument("--spans", default="",
                 help="spans-forward tunings for --breakdown: warps:block:spans items, the "
                      "block for the transitions' rows, the chain and rec_fwd alike")
  p.add_argument("--bwd", default="w8:tf32,w4:tf32,w8:tf32:noinv",
                 help="chunk_bwd tunings for --breakdown: warps:bwd_precision[:noinv] items")
  return p.parse_args()


def parse_variants(spec, interpret):
  """--variants "save,c16+recompute" -> {name: kda_pallas keywords}; '+' combines VARIANTS."""
  variants = {n: dict(interpret=interpret) for n in spec.split(",")}
  for n, kw in variants.items():
    for part in n.split("+"):
      kw.update(VARIANTS[part])
  return variants


def tunings(spec, kernel):
  """--prep / --bwd "w4:tf32x3,w8:tf32:noinv" -> {item: {kernel_warps, kernel_precision}};
  a third field "noinv": without `Config.save_inverse` (chunk_bwd recomputes the inverse)."""
  def tuning(item):
    warps, precision, *rest = item.split(":")
    if rest not in ([], ["noinv"]):
      raise ValueError(f"--{kernel} item {item!r}: a third field can only be 'noinv'")
    return {f"{kernel}_warps": int(warps[1:]), f"{kernel}_precision": precision,
            "save_inverse": not rest}
  return {item: tuning(item) for item in spec.split(",")}


def rec_tuning(item):
  """--rec / --spans item "w4:bv64:s8" -> the Config fields: each item for both
  recurrences, rec_fwd saving states too (no states_block_v)."""
  return dict(rec_warps=int(item.split(":")[0][1:]), block_v=int(item.split(":")[1][2:]),
              spans=int((item.split(":")[2:] or ["s1"])[0][1:]), states_block_v=0,
              states_warps=0)


def run_layers(a):
  """--layer: k3_small's KDA layer per shape (B,T) and --layer_backends item."""
  for shape in a.shapes:
    B, T = map(int, shape.split(",")[:2])
    print(f"{B} x {T} tokens", flush=True)
    layer(B, T, a.reps, a.layer_backends.split(","), profile=a.profile)


def run_breakdowns(a):
  """--breakdown: the pieces' times per shape, per tuning of --prep, --rec, --cots, --bwd,
  --spans."""
  for shape in a.shapes:
    print(shape, flush=True)
    rec = {item: rec_tuning(item) for item in a.rec.split(",")}
    breakdown(tuple(map(int, shape.split(","))), tunings(a.prep, "prep"), rec,
              [int(w) for w in a.cots.split(",")], tunings(a.bwd, "bwd"), a.reps,
              a.interpret, a.chunk, a.gate_dtype,
              {item: dict(rec_tuning(item), transition_block=rec_tuning(item)["block_v"],
                          chain_block=rec_tuning(item)["block_v"])
               for item in a.spans.split(",") if item})


def run_impls(a, variants, shape, x):
  """(impls, refs) at one shape: name -> outputs, gradients and times of our variants,
  fla's (--peer fla) and the chunked form's (--chunk_form); refs: the results compared with
  (ours, fla's, and with --reference the fp32 chunked form's)."""
  t0 = time.time()
  impls = {f"ours[{n}]": r
           for n, r in run_ours(x, variants, a.reps, gate_dtype=a.gate_dtype,
                                profile=a.profile).items()}
  print(f"{shape}: ours done ({time.time() - t0:.0f} s): " + ", ".join(
      f"{n} fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms"
      for n, r in impls.items()), flush=True)
  if a.peer == "fla":
    t0 = time.time()
    impls["fla"] = r = run_fla(x, a.reps)
    print(f"{shape}: fla done ({time.time() - t0:.0f} s): fwd {r['fwd_ms']:.2f} ms, "
          f"fwd+bwd {r['fwd_bwd_ms']:.2f} ms", flush=True)
  refs = {n: r for n, r in impls.items()}
  if a.chunk_form:
    impls["chunk form (XLA, bf16, chunk 32)"] = run_chunk_form(x, a.reps)
  if a.reference:
    refs["ref32"] = run_reference(x, a.gate_dtype)
  return impls, refs


def agreement(impls, refs):
  """name -> {other: relative RMS per output in NAMES} against the fp32 reference and
  between ours and fla's; each printed against TOL."""
  out = {}
  for name, r in impls.items():
    agree = {}
    for other, ref in refs.items():
      if other != name and (other == "ref32" or other == "fla" or name == "fla"):
        agree[other] = {n: rel_rms(r[n], ref[n]) for n in NAMES}
    for other, errs in agree.items():
      bad = [n for n in NAMES if not errs[n] < TOL[n]]
      print(f"  {name} vs {other}: " + " ".join(f"{n} {errs[n]:.1e}" for n in NAMES)
            + (f"  OVER TOLERANCE: {bad}" if bad else "  (within fla's bf16 tolerances)"))
    out[name] = agree
  return out


def compare(a, variants):
  """Ours vs fla (and the references) per shape: agreement and times printed, written to
  <--out>/kda_bench.json after each shape, then a markdown table of the times."""
  rows, dump = [], {}
  for shape in a.shapes:
    B, T, H, D = map(int, shape.split(","))
    impls, refs = run_impls(a, variants, shape, make_inputs(0, B, T, H, D))
    fl = flops(B, T, H, D)
    for name, agree in agreement(impls, refs).items():
      r = impls[name]
      rows.append((shape, name, r["fwd_ms"], r["fwd_bwd_ms"], fl / r["fwd_ms"] / 1e9,
                   3 * fl / r["fwd_bwd_ms"] / 1e9))
      dump[f"{shape} {name}"] = dict(fwd_ms=r["fwd_ms"], fwd_bwd_ms=r["fwd_bwd_ms"],
                                     agree=agree)
    with open(os.path.join(a.out, "kda_bench.json"), "w") as f:
      json.dump(dump, f, indent=1)
  print("\n| B, T, H, D | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |")
  print("|---|---|---|---|---|---|")
  for shape, name, f_ms, fb_ms, f_tf, fb_tf in rows:
    print(f"| {shape} | {name} | {f_ms:.2f} | {fb_ms:.2f} | {f_tf:.0f} | {fb_tf:.0f} |")


def main():
  a = parse_args()
  variants = parse_variants(a.variants, a.interpret)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  if a.layer:
    run_layers(a)
  elif a.breakdown:
    run_breakdowns(a)
  else:
    compare(a, variants)


if __name__ == "__main__":
  main()

"""The LatentMoE layer of a config, forward and forward+backward, with its parts timed apart.

  python benchmarks/moe.py --config=experiments/k3_small.py
  python benchmarks/moe.py --config=experiments/k3_small.py --capacity_factors=2,1.25 \
      --dispatches=capacity,dropless --out=$OUT/moe.md

One layer (`k3jax.model.latent_moe.LatentMoE`, built from the config, bf16 compute), on
random activations x [rows, seq_len, d] (rows: the config's microbatch). Timed per
dispatch and capacity factor, each forward ("fwd") and forward + backward to the
parameters and x ("fwd+bwd", pulling back a fixed cotangent in the output's dtype, and
returning the output), each the median of groups of back-to-back calls, as a step runs:
  layer     the whole layer: router, top-k, down-projection, dispatch, experts, combine,
            latent norm, up-projection, shared experts;
  layer, experts cast once   the layer as a train step with train.cast_params_once runs
            it: the routed expert matrices come in bf16 (cast once per step, outside);
  experts   the experts alone (three matmuls and the GLU) on the layer's own buffer shape
            ([E, rows, C, L] for "capacity", sorted rows for "dropless");
  experts, bf16 weights   the same on weights already in bf16: without the per-call
            fp32 -> bf16 cast of the expert weights (and its transpose for the gradients);
  expert matmuls   the three batched (capacity) or grouped (dropless) matmuls alone at
            the layer's shapes, bf16 weights, each on its own input (no GLU between them,
            no sum of input gradients; "experts, bf16 weights" minus this is that glue);
  dispatch  the dispatch alone: the layer's gathers into buffers and back and the weighted
            combine, with identity experts (capacity), or the sort and unsort (dropless);
            compiled on its own, so XLA may fuse it differently than inside the layer;
  non-expert  layer - experts: dispatch, router, projections, norm and shared experts as
            they run inside the layer.
TFLOP/s: "useful" counts only the (token, slot) pairs (what the model needs), "issued" the
whole buffer including empty capacity slots (what the matmul units run). The ceiling is
ANCHORS.md's 669 TFLOP/s batched einsum fwd+bwd on the H200 (issue 5: expert matmuls >= 80%
of it, the whole layer >= 50%).
"""

from __future__ import annotations

import datetime
import functools
import math
import time

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

from harness import time_jax, write_table
from k3jax import cli
from k3jax import config as k3config
from k3jax import steps
from k3jax.model import latent_moe, layers, moe_dispatch
from k3jax.model.situ_glu import glu_activation
from pallas_kernels.grouped_matmul import grouped_matmul

CEILING_TFLOPS = 669.0  # ANCHORS.md: batched einsum [E, C, K] x [E, K, N], fwd+bwd, H200

_DISPATCHES = flags.DEFINE_list("dispatches", ["capacity"], "moe.dispatch values to time")
_FACTORS = flags.DEFINE_list("capacity_factors", ["2.0", "1.25"],
                             "capacity factors to time (capacity dispatch)")
_ROWS = flags.DEFINE_integer("rows", 0, "rows of x (0: the config's microbatch)")
_REPS = flags.DEFINE_integer("reps", 20, "back-to-back calls per timed group (median of 5 "
                             "groups, after a warm-up)")
_OUT = flags.DEFINE_string("out", None, "also write the markdown table here")


def fwd_and_bwd(f, params, x):
  """f(params, x) -> y (an array or a tuple)  ==>  (forward, forward + backward to params
  and x, dy), jitted. The backward pulls back a fixed cotangent dy in y's dtype, as the
  layer's backward receives one in a train step: no loss of the harness's own is timed.
  It returns y too, as a step uses it: else XLA drops every forward product the backward
  does not need (a matmul's output is not), and a linear part's fwd+bwd would be its bwd."""
  dy = jax.tree.map(
      lambda y: jax.random.normal(jax.random.key(1), y.shape, jnp.float32).astype(y.dtype),
      jax.eval_shape(f, params, x))

  def bwd(params, x, dy):
    y, pull = jax.vjp(f, params, x)
    return y, pull(dy)
  return jax.jit(f), jax.jit(bwd), dy


def dropless(dispatch: str) -> bool:
  """Whether `dispatch` runs the experts on rows sorted by expert (the parts below follow
  it); "auto" is refused, its choice depends on the platform and the shapes."""
  if dispatch == "auto":
    raise ValueError("benchmarks/moe.py times named dispatches: pass --dispatches=dropless,"
                     "capacity (or another of moe_dispatch.DISPATCHES), not auto")
  return dispatch in ("dropless", "expert_parallel_dropless")


def three_matmuls(matmul):
  """The experts' three matmuls (gate, up, down) on bf16 weights, each on its own input
  xs = (gate's, up's, down's): f(w, xs) -> their three outputs. No GLU between them and no
  sum of the gate's and up's input gradients: what the matmuls alone run."""
  return lambda w, xs: (matmul(xs[0], w["g"]), matmul(xs[1], w["u"]), matmul(xs[2], w["d"]))


def layer_parts(cfg_model, rows: int, seq: int, key):
  """The layer and its separately timed parts: name -> (f(params, x), params, x, useful
  forward FLOPs, issued forward FLOPs); 0 FLOPs where no rate is meaningful."""
  m, e = cfg_model, cfg_model.moe
  d, n_exp, lat, hid, k = m.d_model, e.num_experts, e.latent_dim, e.expert_dim, e.top_k
  dtype = jnp.dtype(m.dtype)
  n = rows * seq
  layer = latent_moe.LatentMoE(m, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  kx, kz, ki = jax.random.split(key, 3)
  x = jax.random.normal(kx, (rows, seq, d), dtype)

  def run_layer(state, x):
    return nnx.merge(graphdef, state)(x)[0]

  # The routing the layer itself makes, for the buffers of the parts below.
  _, aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  act = glu_activation(m.ffn.activation, m.ffn.situ_b1, m.ffn.situ_b2)
  w = {"g": layer.w_g[...], "u": layer.w_u[...], "d": layer.w_d[...]}
  z = jax.random.normal(kz, (n, lat), dtype)
  idx = jax.random.randint(ki, (n, k), 0, n_exp)  # random routing: same shapes, similar load
  weights = jnp.full((n, k), 1.0 / k, jnp.float32)
  per_pair = 3 * 2 * lat * hid  # expert FLOPs of one (token, slot) pair, forward
  useful = n * k * per_pair
  dense = n * (2 * d * n_exp + 2 * d * lat + 2 * lat * d + e.num_shared * 3 * 2 * d * e.shared_dim)
  # train.cast_params_once: the step hands the layer its expert matrices already in bf16
  cast_once = steps.apply_views(nnx.as_pure(state), layers.compute_views(state))
  parts = {"layer": (run_layer, state, x, useful + dense, useful + dense),
           "layer, experts cast once": (run_layer, cast_once, x, useful + dense,
                                        useful + dense)}

  w16 = {name: a.astype(dtype) for name, a in w.items()}
  variants = (("experts", act, w), ("experts, bf16 weights", act, w16))
  if dropless(e.dispatch):
    sizes = jnp.full((n_exp,), n * k // n_exp, jnp.int32)
    rows_in = jnp.repeat(z, k, axis=0)
    for name, glu, ws in variants:
      parts[name] = (
          lambda w, rows_, glu=glu: moe_dispatch.ragged_glu_experts(
              w["g"], w["u"], w["d"], glu, dtype, e.gmm_backend)(rows_, sizes),
          ws, rows_in, useful, useful)
    gmm = functools.partial(grouped_matmul, group_sizes=sizes, backend=e.gmm_backend)
    hidden = jax.random.normal(kz, (n * k, hid), dtype)
    parts["expert matmuls"] = (three_matmuls(gmm), w16, (rows_in, rows_in, hidden), useful,
                               useful)
    parts["dispatch"] = (
        lambda _, z: moe_dispatch.dropless_moe(z, idx, weights, lambda r, g: r, n_exp),
        {}, z, 0, 0)
  else:
    capacity = max(1, math.ceil(e.capacity_factor * seq * k / n_exp))
    buf = jax.random.normal(kz, (n_exp, rows, capacity, lat), dtype)
    issued = n_exp * rows * capacity * per_pair
    for name, glu, ws in variants:
      parts[name] = (
          lambda w, b, glu=glu: moe_dispatch.batched_glu_experts(
              w["g"], w["u"], w["d"], glu, dtype)(b), ws, buf, useful, issued)
    hidden = jax.random.normal(kz, (n_exp, rows, capacity, hid), dtype)
    parts["expert matmuls"] = (
        three_matmuls(functools.partial(jnp.einsum, "erck,ekh->erch")), w16,
        (buf, buf, hidden), useful, issued)
    parts["dispatch"] = (
        lambda _, z: moe_dispatch.capacity_moe(z, idx, weights, lambda b: b, n_exp, rows,
                                               capacity)[0],
        {}, z, 0, 0)
  return parts, aux


def main(argv):
  del argv
  base = k3config.validate(cli.CONFIG.value)
  t = base.train
  rows = _ROWS.value or t.global_batch // t.microbatches
  dev = jax.devices()[0]
  e = base.model.moe
  head = (f"LatentMoE of the config: d {base.model.d_model}, {e.num_experts} experts top-"
          f"{e.top_k}, latent {e.latent_dim}, expert hidden {e.expert_dim}, "
          f"{e.num_shared} shared x {e.shared_dim}; x [{rows}, {t.seq_len}, "
          f"{base.model.d_model}] {base.model.dtype}; {datetime.date.today()}, "
          f"{dev.device_kind}, jax {jax.__version__}. Median of 5 groups of {_REPS.value} "
          "back-to-back calls.")
  print("# " + head, flush=True)
  lines = [head, "",
           "| dispatch | capacity factor | part | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s "
           "(useful / issued) | of 669 (issued) | share of layer fwd+bwd |",
           "|---|---|---|---|---|---|---|---|"]
  runs = [(d, float(f)) for d in _DISPATCHES.value
          for f in (_FACTORS.value if not dropless(d) else ["0"])]
  for dispatch, factor in runs:
    cfg = base.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.model.moe.dispatch = dispatch
      if factor:
        cfg.model.moe.capacity_factor = factor
    parts, aux = layer_parts(cfg.model, rows, t.seq_len, jax.random.key(0))
    pairs = rows * t.seq_len * e.top_k
    dropped = int(aux["dropped"])
    print(f"# {dispatch} cf {factor}: {dropped} of {pairs} pairs dropped "
          f"({dropped / pairs:.2%})", flush=True)
    times = {}
    for name, (f, params, x, useful, issued) in parts.items():
      fwd, bwd, dy = fwd_and_bwd(f, params, x)
      if name == "layer":
        t0 = time.perf_counter()
        bwd = bwd.lower(params, x, dy).compile()
        print(f"# {dispatch} cf {factor}: the layer's fwd+bwd compiled in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
      times[name] = (time_jax(fwd, (params, x), _REPS.value),
                     time_jax(bwd, (params, x, dy), _REPS.value), useful, issued)
    lay = times["layer"][1]
    times["non-expert"] = (times["layer"][0] - times["experts"][0],
                           lay - times["experts"][1], 0, 0)
    for name, (f_ms, b_ms, useful, issued) in times.items():
      rate = ""
      if useful:
        rate = f"{3 * useful / b_ms / 1e9:.0f}"
        if issued and issued != useful:
          rate += f" / {3 * issued / b_ms / 1e9:.0f}"
      of_ceiling = f"{3 * (issued or useful) / b_ms / 1e9 / CEILING_TFLOPS:.0%}" if useful else ""
      row = (f"| {dispatch} | {factor or '-'} | {name} | {f_ms:.2f} | {b_ms:.2f} | {rate} | "
             f"{of_ceiling} | {b_ms / lay:.0%} |")
      print(row, flush=True)
      lines.append(row)
    lines.append(f"| {dispatch} | {factor or '-'} | dropped pairs | {dropped} of {pairs} "
                 f"({dropped / pairs:.2%}) | | | | |")
  write_table(lines, _OUT.value)


if __name__ == "__main__":
  cli.run(main)

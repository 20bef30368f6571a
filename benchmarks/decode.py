"""Decoding speed of one config: `k3jax.decode.step` tokens/s against the HBM floor.

  python benchmarks/decode.py --config=experiments/k3_small.py --batches=1,64 \
      --contexts=4096,32768

For each batch size and context length: a cache of that many positions a row (random
contents: the step's work does not depend on them), then --steps one-token steps, timed
after two warm-up steps, the cache donated from step to step as `decode.generate` does.
Random weights, the matrices in the compute dtype (what a server holds).

The floor is the bytes one step must read from HBM at --hbm_tbps: every weight but the
embedding table (only B rows of it) and the routed experts the batch's tokens pick
(expected distinct experts of B x top_k uniform picks), plus the cache (MLA's latents up to
the position, KDA's fp32 state read and written, the conv tails). The cache's memory a
sequence is set against a plain KV cache of the same model: every layer attention with
MLA's heads, keys of nope + rope and values of v a head, in the compute dtype.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from harness import header

from k3jax import axes, cli, decode
from k3jax import config as k3config
from k3jax.model.k3 import K3Model

_BATCHES = flags.DEFINE_list("batches", ["1", "64"], "rows decoded together")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096", "32768"], "positions already cached")
_STEPS = flags.DEFINE_integer("steps", 32, "timed one-token steps")
_HBM = flags.DEFINE_float("hbm_tbps", 4.27, "HBM bandwidth for the floor, TB/s")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", None, "trace 4 more steps of each row with the JAX profiler into "
    "DIR/b<batch>_c<context> (Perfetto copy included, for benchmarks/gpu_trace.py)")


def weights_in(model: K3Model, dtype) -> None:
  """Every floating matrix (2+ dims) of the model in `dtype`, in place; vectors stay."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(
      lambda x: x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)
      else x, state))


def weight_bytes(model: K3Model, batch: int, top_k: int) -> tuple[int, int]:
  """(bytes a step reads of the weights, bytes of all weights): the embedding table only
  `batch` rows, the routed experts only the expected distinct picks."""
  total = read = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = var.get_value()
    n = x.size * x.dtype.itemsize
    total += n
    if path[0] == "embed":
      n = batch * x.shape[-1] * x.dtype.itemsize
    elif [a for a in axes.axis_names(var) if a not in axes.STACKED_AXES][:1] == ["experts"]:
      experts = x.shape[-3]
      picked = experts * (1 - (1 - top_k / experts) ** batch)
      n = int(n * picked / experts)
    read += n
  return read, total


def cache_bytes(cache: dict, context: int, max_len: int) -> tuple[int, int]:
  """(bytes a step reads and writes of the cache at position `context`, the cache's bytes
  for `context` positions): the latents up to it, the states and conv tails both ways."""
  step = held = 0
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    name = str(getattr(path[-1], "key", ""))
    n = x.size * x.dtype.itemsize
    if name == "latent":
      n = n * (context + 1) // max_len
      step += n
    else:
      step += 2 * n
    held += n
  return step, held


def plain_kv_bytes(m, context: int) -> int:
  """A row's plain KV cache of `context` positions: every layer attention with MLA's heads."""
  a = m.mla
  per_token = a.num_heads * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)
  return m.num_layers * context * per_token * jnp.dtype(m.dtype).itemsize


def random_cache(cache: dict, key) -> dict:
  leaves, tree = jax.tree.flatten(cache)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [
      (0.05 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
      for k, x in zip(keys, leaves)])


def main(argv):
  del argv
  cfg = k3config.validate(cli.CONFIG.value)
  m = cfg.model
  print(header(f"{m.num_layers} layers, d {m.d_model}, {m.moe.num_experts} experts "
               f"top-{m.moe.top_k}", f"weights {m.dtype}, {_STEPS.value} steps timed"),
        flush=True)
  model = K3Model(m, rngs=nnx.Rngs(0))
  weights_in(model, jnp.dtype(m.dtype))
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, tok, c, pos: decode.step(nnx.merge(graphdef, s), tok, c, pos),
                donate_argnums=(2,))
  print("\n| batch | context | step | tokens/s | HBM floor | of floor | weights read | "
        "cache read+written | cache a sequence | plain KV cache a sequence |\n"
        "|---|---|---|---|---|---|---|---|---|---|", flush=True)
  for b in map(int, _BATCHES.value):
    for context in map(int, _CONTEXTS.value):
      max_len = context + _STEPS.value + 6
      cache = random_cache(decode.init_cache(model, b, max_len), jax.random.key(1))
      tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.vocab_size, (b, 1)),
                           jnp.int32)
      step_bytes, held = cache_bytes(cache, context, max_len)
      w_read, _ = weight_bytes(model, b, m.moe.top_k)
      t0 = time.perf_counter()
      for i in range(2):
        logits, cache = run(state, tokens, cache, jnp.full((b,), context + i, jnp.int32))
      logits.block_until_ready()
      warm = time.perf_counter() - t0
      t0 = time.perf_counter()
      for i in range(2, _STEPS.value + 2):
        logits, cache = run(state, tokens, cache, jnp.full((b,), context + i, jnp.int32))
      logits.block_until_ready()
      secs = (time.perf_counter() - t0) / _STEPS.value
      floor = (w_read + step_bytes) / (_HBM.value * 1e12)
      print(f"| {b} | {context:,} | {secs * 1e3:.2f} ms | {b / secs:,.0f} | "
            f"{floor * 1e3:.2f} ms | {floor / secs:.0%} | {w_read / 2**30:.2f} GiB | "
            f"{step_bytes / 2**30:.3f} GiB | {held / b / 2**20:.1f} MiB | "
            f"{plain_kv_bytes(m, context) / 2**20:,.0f} MiB |", flush=True)
      if _PROFILE_DIR.value:
        with jax.profiler.trace(f"{_PROFILE_DIR.value}/b{b}_c{context}",
                                create_perfetto_trace=True):
          for i in range(_STEPS.value + 2, _STEPS.value + 6):
            logits, cache = run(state, tokens, cache, jnp.full((b,), context + i, jnp.int32))
          logits.block_until_ready()
      del cache
      print(f"#   (compile + 2 warm-up steps {warm:.1f} s)", flush=True)


if __name__ == "__main__":
  cli.run(main)

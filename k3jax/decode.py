"""Decoding with K3Model: a cache per layer and a one-token step.

  logits, cache = prefill(model, prompts, max_len)             # [B, P, vocab]
  logits, cache = step(model, tokens[:, t:t + 1], cache, pos)   # [B, 1, vocab]
  ids = generate(model, prompts, max_new_tokens=..., eos_id=..., key=...)

Only mixers carry state (KDA: [B, H, K, K] fp32 and the conv tail; MLA: the latent
[B, max_len, kv_lora + rope]); rows advance at their own `pos` [B]."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import axes
from k3jax.model import attn_res, embedding
from k3jax.model.k3 import K3Model


def init_cache(model: K3Model, batch: int, max_len: int) -> dict:
  """Empty caches for `batch` rows of up to `max_len` positions (module docstring)."""
  dtype = model.dtype
  cache = {"prefix": [layer.init_cache(batch, max_len, dtype) for layer in model.prefix],
           "cycles": [],
           "suffix": [layer.init_cache(batch, max_len, dtype) for layer in model.suffix]}
  if model.cycles is not None:
    n = model.plan.num_cycles

    def stacked(layer):
      one = layer.init_cache(batch, max_len, dtype)
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), one)
    # the layers of a cycle have the same shapes in every cycle: build from the first
    graphdef, state = nnx.split(model.cycles)
    first = nnx.merge(graphdef, jax.tree.map(lambda x: x[0], state))
    cache["cycles"] = [stacked(layer) for layer in first.layers]
  return cache


def step(model: K3Model, tokens: jax.Array, cache: dict, pos: jax.Array):
  """tokens [B, 1] at pos [B] -> (logits [B, 1, vocab], cache); pos < max_len."""
  with axes.unsplit("seq"):               # one position a row: not split over `context`
    x = embedding.lookup(model.embed[...], tokens, model.dtype)
    return _stack(model, x, lambda layer, s, c: layer.step(s, c, pos), cache, pos)


def prefill(model: K3Model, tokens: jax.Array, max_len: int, media=None):
  """Prompts [B, P] -> (logits [B, P, vocab], cache of `max_len`); media: a PackedMedia."""
  if tokens.shape[1] > max_len:
    raise ValueError(f"prefill: prompts of {tokens.shape[1]} tokens do not fit a cache of "
                     f"{max_len} positions")
  if media is None:
    x = embedding.lookup(model.embed[...], tokens, model.dtype)
  else:
    x = model.embed_with_images(tokens, media)
  segment_ids = jnp.ones(tokens.shape, jnp.int32)
  return _stack(model, x, lambda layer, s, _: layer.prefill(s, segment_ids, max_len))


def _stack(model: K3Model, x: jax.Array, layer_fn, cache: dict | None = None, pos=None):
  """The stack on x [B, T, d] -> (logits, cache) by layer_fn(layer, stream, cache or None)."""
  stream = attn_res.init_state(x, model.num_slots) if model.use_attn_res else x
  new = {"prefix": [], "cycles": [], "suffix": []}

  def apply(layer, stream, full, index=()):
    if cache is None:
      return layer_fn(layer, stream, None)
    stream, entry = layer_fn(layer, stream, jax.tree.map(lambda a: a[index], full))
    return stream, layer.write_cache(full, entry, pos, index)

  def group(name, layers):
    nonlocal stream
    for i, layer in enumerate(layers):
      stream, c = apply(layer, stream, None if cache is None else cache[name][i])
      new[name].append(c)

  group("prefix", model.prefix)
  if model.cycles is not None:
    graphdef, state = nnx.split(model.cycles)
    if cache is None:
      def collect(stream, cycle_state):
        out = []
        for layer in nnx.merge(graphdef, cycle_state).layers:
          stream, c = apply(layer, stream, None)
          out.append(c)
        return stream, out
      stream, new["cycles"] = jax.lax.scan(collect, stream, state)
    else:
      def carry(carried, cycle_state):
        stream, caches, i = carried
        caches = list(caches)
        for j, layer in enumerate(nnx.merge(graphdef, cycle_state).layers):
          stream, caches[j] = apply(layer, stream, caches[j], (i,))
        return (stream, caches, i + 1), None
      (stream, new["cycles"], _), _ = jax.lax.scan(
          carry, (stream, cache["cycles"], jnp.zeros((), jnp.int32)), state)
  group("suffix", model.suffix)
  h = attn_res.read(stream, model.out_query) if model.use_attn_res else stream
  return model.logits(model.final_norm(h)), new


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """Next tokens [B] from logits [B, vocab]: argmax at temperature 0, else top_k/top_p."""
  logits = logits.astype(jnp.float32)
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(
        ordered, axis=-1)
    cut = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cut, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model: K3Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             eos_id: int | None, key: jax.Array, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, media=None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
  """Each prompt continued by up to `max_new_tokens` tokens, a row stopping at `eos_id`
  (kept). The shortest prompt's length is prefilled; media placeholders must lie within
  it. on_token(row, id) sees each new token. Returns the new tokens per row."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate: every prompt needs at least one token (e.g. bos)")
  b, lengths = len(prompts), [len(p) for p in prompts]
  max_len, first = max(lengths) + max_new_tokens, min(lengths)
  tokens = np.zeros((b, max_len), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, tok, c, pos: step(nnx.merge(graphdef, s), tok, c, pos),
                donate_argnums=(2,))
  pick = jax.jit(lambda logits, k: sample(logits, k, temperature=temperature, top_k=top_k,
                                          top_p=top_p))
  if media is not None and np.any(tokens[:, first:] == model.placeholder_id):
    raise ValueError(f"generate: image placeholders past the first {first} tokens (the "
                     "shortest prompt): put the images before that, or prompts of one length")
  logits, cache = jax.jit(lambda s, tok, m: prefill(nnx.merge(graphdef, s), tok, max_len, m))(
      state, jnp.asarray(tokens[:, :first]), media)
  last = logits[:, -1]                       # at position t, for token t + 1
  out: list[list[int]] = [[] for _ in range(b)]
  done = [max_new_tokens == 0] * b
  for t in range(first - 1, max_len - 1):
    nxt = np.asarray(pick(last, jax.random.fold_in(key, t)))
    for i in range(b):
      if t + 1 < lengths[i] or done[i]:
        continue
      tokens[i, t + 1] = nxt[i]
      out[i].append(int(nxt[i]))
      if on_token is not None:
        on_token(i, int(nxt[i]))
      done[i] = len(out[i]) == max_new_tokens or nxt[i] == eos_id
    if all(done) or t + 2 >= max_len:
      break
    logits, cache = run(state, jnp.asarray(tokens[:, t + 1:t + 2]), cache,
                        jnp.full((b,), t + 1, jnp.int32))
    last = logits[:, 0]
  return out

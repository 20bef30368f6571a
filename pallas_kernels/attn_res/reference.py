"""The Block AttnRes read in plain JAX (K3_SPEC 3): h = sum_s alpha_s v_s,
alpha = softmax_s(w . (RMSNorm(v_s) * g)) over the valid sources, in fp32.

The sources come as one buffer [S, B, T, d] (a scanned stack's fixed carry) or as a
sequence of S arrays [B, T, d] (a stack unrolled in Python: only the sources that exist)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

F32 = jnp.float32


Sources = jax.Array | Sequence[jax.Array]   # [S, B, T, d], or S arrays [B, T, d]


def is_buffer(sources: Sources) -> bool:
  return not isinstance(sources, (tuple, list))


def sources_shape(sources: Sources) -> tuple[int, ...]:
  """(S, B, T, d) of either form."""
  return tuple(sources.shape) if is_buffer(sources) else (len(sources), *sources[0].shape)


def check_shapes(sources: Sources, valid, query: jax.Array, key_gain: jax.Array) -> None:
  """ValueError naming the mismatch: sources [S, B, T, d] (or S alike [B, T, d]), valid [S],
  query / key_gain [d]."""
  if is_buffer(sources):
    if sources.ndim != 4:
      raise ValueError(f"attn_res: sources must be [S, B, T, d], got shape {sources.shape}")
  else:
    shapes = {(tuple(s.shape), jnp.dtype(s.dtype)) for s in sources}
    if not sources or len(shapes) != 1 or sources[0].ndim != 3:
      raise ValueError("attn_res: a sequence of sources must be one or more [B, T, d] of one "
                       f"shape and dtype, got {sorted(shapes, key=str)}")
  S, *_, d = sources_shape(sources)
  if valid is not None and valid.shape != (S,):
    raise ValueError(f"attn_res: valid must be [S] = [{S}], got shape {valid.shape}")
  for name, a in (("query", query), ("key_gain", key_gain)):
    if a.shape != (d,):
      raise ValueError(f"attn_res: {name} must be [d] = [{d}], got shape {a.shape}")


def attend_reference(sources: Sources, valid: jax.Array | None, query: jax.Array,
                     key_gain: jax.Array, eps: float) -> jax.Array:
  """sources [S, B, T, d] (or S arrays [B, T, d]), valid [S] bool or None (all), query,
  key_gain [d] -> h [B, T, d] in the sources' dtype. The gain is folded into the query: the
  normalised keys are shared."""
  check_shapes(sources, valid, query, key_gain)
  if not is_buffer(sources):
    sources = jnp.stack(sources)
  v = sources.astype(F32)
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  wg = query.astype(F32) * key_gain.astype(F32)
  logits = jnp.einsum("sbtd,qd->qsbt", keys, wg[None], precision=jax.lax.Precision.HIGHEST)[0]
  if valid is not None:
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)
  h = jnp.einsum("sbt,sbtd->btd", alpha, sources.astype(F32),
                 precision=jax.lax.Precision.HIGHEST)
  return h.astype(sources.dtype)

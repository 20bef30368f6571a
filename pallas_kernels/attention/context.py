"""Causal attention with T split into c slices over a mesh axis, two ways:
`context_parallel` keeps each device's query slice and gives it all keys, values and ids of
its rows; `heads_exchanged` trades a device's slice of all its heads for all T of a c-th of
them, so every device runs the unsplit kernel on the same causal work."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.attention.flash import flash_tpu, unique_padding_ids
from pallas_kernels.shard_types import axis_names, axis_size


def kv_spec(x, batch_axis, head_axis) -> P:
  """The spec of keys or values x [B, T, H or 1, D]: all T; H = 1 replicated."""
  return P(batch_axis) if x.shape[2] == 1 else P(batch_axis, None, head_axis)


def context_parallel(local, q, k, v, segment_ids, *, return_max_logit, mesh, batch_axis,
                     head_axis, seq_axis):
  """local(q, k, v, segment_ids, q_offset) -> (out, max logit or None) per query slice."""
  c = axis_size(mesh, seq_axis)
  if q.shape[1] % c:
    raise ValueError(f"T = {q.shape[1]} is not a multiple of the {c} slices of {seq_axis}")
  n = q.shape[1] // c

  def body(q, k, v, ids):
    out, logit = local(q, k, v, ids, jax.lax.axis_index(seq_axis) * n)
    if not return_max_logit:
      return out
    return out, jax.lax.pmax(logit, axis_names(batch_axis, seq_axis))

  tok_q = P(batch_axis, seq_axis, head_axis)
  out_specs = (tok_q, P(head_axis)) if return_max_logit else tok_q
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(body, mesh=mesh, in_specs=(tok_q, kv_spec(k, batch_axis, head_axis),
                                                  kv_spec(v, batch_axis, head_axis),
                                                  P(batch_axis)),
                       out_specs=out_specs, check_vma=False)(q, k, v, segment_ids)


def heads_divide(q, mesh, head_axis, seq_axis) -> bool:
  """Whether each device's heads of q [B, T, H, D] split into the c slices of seq_axis."""
  return (q.shape[2] // axis_size(mesh, head_axis)) % axis_size(mesh, seq_axis) == 0


def heads_exchanged(local, q, k, v, segment_ids, *, return_max_logit, mesh, batch_axis,
                    head_axis, seq_axis):
  """local(q, k, v, segment_ids) -> (out, max logit or None) over all T for H / c heads.
  An all-to-all over seq_axis turns q, per-head k and v [B, T/c, H, D] into [B, T, H/c, D]
  (keys and values shared by all heads are gathered instead) and the output back."""
  c = axis_size(mesh, seq_axis)
  if q.shape[1] % c:
    raise ValueError(f"T = {q.shape[1]} is not a multiple of the {c} slices of {seq_axis}")
  if not heads_divide(q, mesh, head_axis, seq_axis):
    raise ValueError(f"{q.shape[2]} heads over {head_axis} do not split into the {c} "
                     f"slices of {seq_axis}")
  to_heads = lambda x: jax.lax.all_to_all(x, seq_axis, 2, 1, tiled=True)     # noqa: E731
  gather = lambda x: jax.lax.all_gather(x, seq_axis, axis=1, tiled=True)     # noqa: E731

  def body(q, k, v, ids):
    k, v = (to_heads(x) if x.shape[2] > 1 else gather(x) for x in (k, v))
    out, logit = local(to_heads(q), k, v, gather(ids))
    out = jax.lax.all_to_all(out, seq_axis, 1, 2, tiled=True)
    if not return_max_logit:
      return out
    logit = jax.lax.all_gather(logit, seq_axis, axis=0, tiled=True)
    rows = axis_names(batch_axis)
    return out, jax.lax.pmax(logit, rows) if rows else logit

  tok = P(batch_axis, seq_axis, head_axis)
  kv = lambda x: P(batch_axis, seq_axis, head_axis if x.shape[2] > 1 else None)  # noqa: E731
  out_specs = (tok, P(head_axis)) if return_max_logit else tok
  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(body, mesh=mesh, in_specs=(tok, kv(k), kv(v), P(batch_axis, seq_axis)),
                       out_specs=out_specs, check_vma=False)(q, k, v, segment_ids)


def flash_tpu_window(q, k, v, segment_ids, q_offset, *, scale, **kernel_kw):
  """Causal splash for the n queries at traced q_offset. Splash masks are static: the kernel
  sees the first T - n keys then the n at q_offset, causal at offset T - n; prefix keys at or
  after q_offset get an id no query has (the last device's work: no slower than skipping)."""
  n, t = q.shape[1], k.shape[1]
  ids = unique_padding_ids(segment_ids)
  window = lambda x: jnp.concatenate(                                 # noqa: E731
      [x[:, :t - n], jax.lax.dynamic_slice_in_dim(x, q_offset, n, axis=1)], axis=1)
  never = jnp.iinfo(ids.dtype).min
  prefix_ids = jnp.where(jnp.arange(t - n) < q_offset, ids[:, :t - n], never)
  q_ids = jax.lax.dynamic_slice_in_dim(ids, q_offset, n, axis=1)
  kv_ids = jnp.concatenate([prefix_ids, q_ids], axis=1)
  return flash_tpu(q, window(k), window(v), q_ids, kv_ids, scale=scale, causal=True,
                   **kernel_kw)

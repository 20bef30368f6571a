"""Context parallelism for causal attention: the queries split along T into c equal
contiguous slices over a mesh axis, each device holding all keys, values and ids of its
rows. `context_parallel` runs a per-device function under `jax.shard_map` with its slice's
global offset; `flash_tpu_window` is the splash kernel for one slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.attention.flash import flash_tpu, unique_padding_ids
from pallas_kernels.shard_types import axis_names, axis_size


def kv_spec(x, batch_axis, head_axis) -> P:
  """Where a kernel's shard of keys or values x [B, T, H or 1, D] lives: all T of its rows,
  its heads (H = 1, shared by all heads: every device's copy)."""
  return P(batch_axis) if x.shape[2] == 1 else P(batch_axis, None, head_axis)


def context_parallel(local, q, k, v, segment_ids, *, return_max_logit, mesh, batch_axis,
                     head_axis, seq_axis):
  """local(q, k, v, segment_ids, q_offset) -> (out, max logit [H] or None) per device.

  q: [B, T, H, Dqk], k: [B, T, H or 1, Dqk], v: [B, T, H, Dv], segment_ids: [B, T]
  (global views). Each device gets the queries q[:, o:o + T/c] with o = q_offset, its
  linear index along seq_axis times T/c, and all T keys, values and ids of its rows.
  Returns [B, T, H, Dv] and, if return_max_logit, the max logit [H] over all devices.
  """
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


def flash_tpu_window(q, k, v, segment_ids, q_offset, *, scale, **kernel_kw):
  """Causal splash attention for the n = Tq queries at q_offset (a traced multiple of n)
  of a sequence of T keys. q: [B, n, H, Dqk]; k: [B, T, H, Dqk]; v: [B, T, H, Dv];
  segment_ids [B, T] (0 = padding). -> [B, n, H, Dv]. kernel_kw: `flash_tpu`'s.

  Splash masks are static and q_offset is not, so the kernel gets a window of the keys:
  the first T - n, then the n of the diagonal block (those at q_offset), under one static
  mask, causal with offset T - n (prefix visible, diagonal block causal); prefix keys at or
  after q_offset get an id no query has. Each device computes c - 1/2 of the n x n blocks
  (c = T / n; earlier devices some in vain), what the last device needs anyway: the step
  takes as long as with per-device skipping. Splash's own backward; its mask tables cover
  n x T (built in numpy when tracing, O(n T)). Rejected: (a) per-block results merged by
  log-sum-exp (splash's VJP takes no log-sum-exp cotangent: a backward of our own through
  its private kernels, for the same block count); (b) a lax.switch over c static masks (c
  kernels to compile, no faster step); (c) splash's q_seq_shards, mask tables sharded over
  the devices (tables for T x T, same step time; worth it only for a load-balanced layout).
  """
  n, t = q.shape[1], k.shape[1]
  ids = unique_padding_ids(segment_ids)
  window = lambda x: jnp.concatenate(                                 # noqa: E731
      [x[:, :t - n], jax.lax.dynamic_slice_in_dim(x, q_offset, n, axis=1)], axis=1)
  never = jnp.iinfo(ids.dtype).min    # below the ids of padding and of padded rows
  prefix_ids = jnp.where(jnp.arange(t - n) < q_offset, ids[:, :t - n], never)
  q_ids = jax.lax.dynamic_slice_in_dim(ids, q_offset, n, axis=1)
  kv_ids = jnp.concatenate([prefix_ids, q_ids], axis=1)
  return flash_tpu(q, window(k), window(v), q_ids, kv_ids, scale=scale, causal=True,
                   **kernel_kw)

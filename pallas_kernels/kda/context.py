"""KDA with T split over a mesh axis (context parallelism). A slice maps the state it is
handed affinely, S_out = P S + D (P [K, K], D [K, V]); each device runs any backend twice:
from zero state (outputs o0, D) and with v = 0 from S = I (P, and r_t = P_t^T scale q_t),
so o_t = o0_t + S^T r_t. The maps compose along the axis in a log-depth ppermute scan; a
slice that starts a document takes zero state. Plain JAX around the backend: autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _from_previous(x, axis, shift: int, n: int):
  """x of the device `shift` places before along `axis` (zeros where there is none)."""
  return jax.lax.ppermute(x, axis, perm=[(j, j + shift) for j in range(n - shift)])


def kda_context(run, q, k, v, g, beta, *, axis, segment_ids, initial_state=None):
  """One device's slice inside `shard_map` over `axis`; run: a backend with `kda_naive`'s
  contract. Returns o and the state leaving this slice [B, H, K, V] fp32."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  n = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  f32 = jnp.float32
  common = dict(segment_ids=segment_ids, output_final_state=True)
  o0, D = run(q, k, v, g, beta, initial_state=None, **common)
  eye = jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))
  reads, P = run(q, k, jnp.zeros((B, T, H, K), v.dtype), g, beta, initial_state=eye,
                 **common)

  # the handed state carries over only where the document continues across the boundary
  last_id = _from_previous(segment_ids[:, -1], axis, 1, n)
  carries = ((segment_ids[:, 0] == last_id) | (me == 0)).astype(f32)[:, None, None, None]
  A, b = P * carries, D

  d = 1
  while d < n:
    A_prev, b_prev = (_from_previous(x, axis, d, n) for x in (A, b))
    later = me >= d
    b = jnp.where(later, jnp.matmul(A, b_prev, precision=_HI) + b, b)
    A = jnp.where(later, jnp.matmul(A, A_prev, precision=_HI), A)
    d *= 2
  h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
  exit_state = jnp.matmul(A, h0, precision=_HI) + b
  handed = jnp.where(me == 0, h0, _from_previous(exit_state, axis, 1, n))
  entering = carries * handed
  o = o0.astype(f32) + jnp.einsum("bthk,bhkv->bthv", reads.astype(f32), entering,
                                  precision=_HI)
  return o.astype(q.dtype), exit_state


def kda_context_sharded(run, q, k, v, g, beta, *, mesh, seq_axis, batch_axis=None,
                        head_axis=None, initial_state=None, segment_ids=None,
                        output_final_state=False):
  """`kda_context` under `jax.shard_map`: T over seq_axis, B over batch_axis, H over head_axis."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  B, T, H, K = q.shape
  tok, row, state = (P(batch_axis, seq_axis, head_axis), P(batch_axis, seq_axis),
                     P(batch_axis, head_axis))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  if initial_state is None:
    initial_state = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)

  def local(q, k, v, g, beta, segment_ids, initial_state):
    o, exit_state = kda_context(run, q, k, v, g, beta, axis=seq_axis,
                                segment_ids=segment_ids, initial_state=initial_state)
    return o, exit_state[None]

  # Exits stacked along the axis, not replicated: a replicated output's cotangent would
  # count once per device. check_vma=False: pallas_call's outputs carry no vma.
  o, exits = jax.shard_map(
      local, mesh=mesh, in_specs=(tok, tok, tok, tok, tok, row, state),
      out_specs=(tok, P(seq_axis, batch_axis, head_axis)), check_vma=False)(
          q, k, v, g, beta, segment_ids, initial_state)
  return (o, exits[-1]) if output_final_state else o

"""KDA with T split over a mesh axis (context parallelism), for any backend. A slice maps
the state it is handed affinely, S_out = P S + D (P [K, K], D [K, V]); each device runs the
backend twice: from zero state (outputs o0, D) and with v = 0 from S = I (P, and the reads
r_t = P_t^T scale q_t), so o_t = o0_t + S^T r_t. The maps compose along the axis in a
log-depth ppermute scan (`scan_maps`); a slice that starts a document takes zero state.
Plain JAX around the backend: autodiff. The kernel backend chains its own spans instead, one
pass (`context_kernel.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def shifted(x, axis, shift: int):
  """x of the device `shift` places before along `axis` (after, for shift < 0); zeros where
  there is none."""
  n = jax.lax.axis_size(axis)
  return jax.lax.ppermute(x, axis, perm=[(j, j + shift) for j in range(n)
                                         if 0 <= j + shift < n])


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HI)


def scan_maps(P, D, axis, *, reverse=False):
  """Inclusive scan of the devices' affine maps S -> P S + D [..., K, K], [..., K, V] along
  axis, in log depth: each device gets the map of the devices up to it applied in order
  (reverse: of itself and the devices after it, the last applied first)."""
  n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  d = 1
  while d < n:
    P_in, D_in = (shifted(x, axis, -d if reverse else d) for x in (P, D))
    has = me + d < n if reverse else me >= d
    P, D = jnp.where(has, _mm(P, P_in), P), jnp.where(has, _mm(P, D_in) + D, D)
    d *= 2
  return P, D


def carries_over(segment_ids, axis):
  """[B] 1.0 where the state leaving the previous device's slice enters this one's (its
  first document continues from there; always on the first device), else 0.0."""
  last_id = shifted(segment_ids[:, -1], axis, 1)
  first = jax.lax.axis_index(axis) == 0
  return ((segment_ids[:, 0] == last_id) | first).astype(jnp.float32)


def entering_states(P, D, h0, carries, axis):
  """(the state entering this device's slice, the state leaving it) [..., K, V] from the
  slices' maps (P already zeroed where the state does not carry over) and h0 entering the
  first slice."""
  P_all, D_all = scan_maps(P, D, axis)
  leaving = _mm(P_all, h0) + D_all
  first = jax.lax.axis_index(axis) == 0
  return jnp.where(first, h0, carries * shifted(leaving, axis, 1)), leaving


def kda_context(run, q, k, v, g, beta, *, axis, segment_ids, initial_state=None):
  """One device's slice inside `shard_map` over `axis`; run: a backend with `kda_naive`'s
  contract. Returns o and the state leaving this slice [B, H, K, V] fp32."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  f32 = jnp.float32
  common = dict(segment_ids=segment_ids, output_final_state=True)
  o0, D = run(q, k, v, g, beta, initial_state=None, **common)
  eye = jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))
  reads, P = run(q, k, jnp.zeros((B, T, H, K), v.dtype), g, beta, initial_state=eye,
                 **common)
  carries = carries_over(segment_ids, axis)[:, None, None, None]
  h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
  entering, leaving = entering_states(P * carries, D, h0, carries, axis)
  o = o0.astype(f32) + jnp.einsum("bthk,bhkv->bthv", reads.astype(f32), entering,
                                  precision=_HI)
  return o.astype(q.dtype), leaving


def kda_context_sharded(local, q, k, v, g, beta, *, mesh, seq_axis, batch_axis=None,
                        head_axis=None, initial_state=None, segment_ids=None,
                        output_final_state=False):
  """local (`kda_context` with its backend, or `context_kernel.kda_pallas_context`) under
  `jax.shard_map`: T over seq_axis, B over batch_axis, H over head_axis."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  B, T, H, K = q.shape
  tok, row, state = (P(batch_axis, seq_axis, head_axis), P(batch_axis, seq_axis),
                     P(batch_axis, head_axis))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  if initial_state is None:
    initial_state = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)

  def one_slice(q, k, v, g, beta, segment_ids, initial_state):
    o, exit_state = local(q, k, v, g, beta, axis=seq_axis, segment_ids=segment_ids,
                          initial_state=initial_state)
    return o, exit_state[None]

  # Exits stacked along the axis, not replicated: a replicated output's cotangent would
  # count once per device. check_vma=False: pallas_call's outputs carry no vma.
  o, exits = jax.shard_map(
      one_slice, mesh=mesh, in_specs=(tok, tok, tok, tok, tok, row, state),
      out_specs=(tok, P(seq_axis, batch_axis, head_axis)), check_vma=False)(
          q, k, v, g, beta, segment_ids, initial_state)
  return (o, exits[-1]) if output_final_state else o

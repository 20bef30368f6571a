"""KDA with every sequence split along T over a mesh axis (context parallelism).

A device holds one contiguous slice of each sequence. The state entering its slice depends
on all slices before it, but only affinely: the slice maps the state S it is handed to
S_out = P S + D, with P [K, K] and D [K, V] (the delta rule acts on S from the left).
Each device runs its slice twice through any backend: once as it is from a zero state,
which gives the outputs o0 and D; once with zero values from the state I (K columns),
which gives P and per token r_t = P_t^T (scale q_t), so that the true output is
o_t = o0_t + S^T r_t once the entering state S is known. (One pass with the state widened
to [K, V + K] gives the same, but the GPU kernels ran it several times slower than two
passes at their tuned width: benchmarks/results/context_parallel.md.)

The devices' maps are then composed along the axis by a log-depth scan (ppermute rounds:
each device's map composed with the one d devices before it, d = 1, 2, 4, ...), the exit
state of every slice follows, and each device takes its predecessor's. Document boundaries
cut the chain: a slice whose first token starts a new document enters with zero state (P of
a slice with a boundary inside is already zero: the backends reset the state there).
Everything is plain JAX around the backend, so gradients come by autodiff (ppermute
transposes to the reverse permutation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _from_previous(x, axis, shift: int, n: int):
  """x of the device `shift` places before along `axis` (zeros where there is none)."""
  return jax.lax.ppermute(x, axis, perm=[(j, j + shift) for j in range(n - shift)])


def kda_context(run, q, k, v, g, beta, *, axis, segment_ids, initial_state=None):
  """One device's slice of context-parallel KDA, inside `shard_map` over `axis`.

  Args:
    run: a KDA backend, run(q, k, v, g, beta, initial_state=, segment_ids=,
      output_final_state=True) -> (o, final state), with `kda_naive`'s contract.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H]: this device's
      slice of T (slices in device order along `axis`).
    axis: the mesh axis name (or tuple of names) the sequence is split over.
    segment_ids: [B, T] int, this slice's ids (documents may cross slices).
    initial_state: [B, H, K, V] float32 entering the whole sequence (the first device's
      slice), or None (zeros).

  Returns:
    o [B, T, H, V] in q's dtype, and the state leaving this slice [B, H, K, V] float32.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  n = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  f32 = jnp.float32
  common = dict(segment_ids=segment_ids, output_final_state=True)
  o0, D = run(q, k, v, g, beta, initial_state=None, **common)   # [B, T, H, V], [B, H, K, V]
  eye = jnp.broadcast_to(jnp.eye(K, dtype=f32), (B, H, K, K))
  reads, P = run(q, k, jnp.zeros((B, T, H, K), v.dtype), g, beta, initial_state=eye,
                 **common)                                      # [B, T, H, K], [B, H, K, K]

  # The state handed over from the previous slice reaches this one only if the document
  # continues across the boundary (the first slice takes the initial state as it is).
  last_id = _from_previous(segment_ids[:, -1], axis, 1, n)
  carries = ((segment_ids[:, 0] == last_id) | (me == 0)).astype(f32)[:, None, None, None]
  A, b = P * carries, D            # this slice's map: S_out = A S_handed + b

  d = 1
  while d < n:                     # inclusive scan: the map of slices [0, me] composed
    A_prev, b_prev = (_from_previous(x, axis, d, n) for x in (A, b))
    later = me >= d
    b = jnp.where(later, jnp.matmul(A, b_prev, precision=_HI) + b, b)
    A = jnp.where(later, jnp.matmul(A, A_prev, precision=_HI), A)
    d *= 2
  h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
  exit_state = jnp.matmul(A, h0, precision=_HI) + b             # leaving this slice
  handed = jnp.where(me == 0, h0, _from_previous(exit_state, axis, 1, n))
  entering = carries * handed
  o = o0.astype(f32) + jnp.einsum("bthk,bhkv->bthv", reads.astype(f32), entering,
                                  precision=_HI)
  return o.astype(q.dtype), exit_state


def kda_context_sharded(run, q, k, v, g, beta, *, mesh, seq_axis, batch_axis=None,
                        head_axis=None, initial_state=None, segment_ids=None,
                        output_final_state=False):
  """`kda_context` under `jax.shard_map`: T split over `seq_axis`, B over `batch_axis`,
  heads over `head_axis` (global arrays in, as `pallas_kernels.kda.kda` takes them).
  Returns o [B, T, H, V], plus the final state [B, H, K, V] if output_final_state."""
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

  # The exits come back stacked along the axis (the last one is the final state), not
  # as one replicated array: a replicated output's cotangent would be counted once per
  # device. check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  o, exits = jax.shard_map(
      local, mesh=mesh, in_specs=(tok, tok, tok, tok, tok, row, state),
      out_specs=(tok, P(seq_axis, batch_axis, head_axis)), check_vma=False)(
          q, k, v, g, beta, segment_ids, initial_state)
  return (o, exits[-1]) if output_final_state else o

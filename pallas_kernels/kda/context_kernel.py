"""KDA with T split over a mesh axis on the kernels' own spans (GPU, interpret): a device's
slice is one more span. Forward: prep, the slice's map st_out = st_in A + B composed from its
spans' transitions, the maps chained along the axis, then the recurrence from the state
entering the slice. Backward: each span's own cotangent, the slice's transposed map
(d st_in = d st_out A^T + E) chained back along the axis, then the recurrence's backward
from the cotangent leaving the slice. One pass of the kernels and the transitions, where
`context.kda_context` runs a backend twice. States in the kernels' row form [V, K]."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import blocks, chunk_kernels, spans
from pallas_kernels.kda.context import carries_over, entering_states, scan_maps, shifted
from pallas_kernels.kda.pallas import (input_cotangents, kernel_inputs, mask_cotangents,
                                      no_backward)
from pallas_kernels.platform import lowered_once

_HI = jax.lax.Precision.HIGHEST


def _slice_map(t, K):
  """The slice's map st -> st A + b (A [B, H, K, K], b [B, H, V, K]) from its spans'
  transitions t [B, H, S, K + V, K], composed in order."""
  A, b = t[:, :, 0, :K], t[:, :, 0, K:]
  for s in range(1, t.shape[2]):
    A_s = t[:, :, s, :K]
    A, b = jnp.matmul(A, A_s, precision=_HI), jnp.matmul(b, A_s, precision=_HI) + t[:, :, s, K:]
  return A, b


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _leaving_cotangents(A, E, d_exit, carries, axis):
  """The cotangent of the state leaving this slice: its own exit's plus what the later
  slices hand back (each maps x -> carries (x A^T + E) onto the slice before it). `scan_maps`
  composes column-form maps, y = x^T -> A y + E^T."""
  e = jnp.matmul(A, _t(d_exit), precision=_HI) + carries * _t(E)
  _, later = scan_maps(A, e, axis, reverse=True)
  return d_exit + _t(shifted(later, axis, -1))


@lowered_once(0, 1)
def _forward(cfg, axis, q, k, v, g, beta, h0, masks, carries):
  prep = chunk_kernels.prep(cfg, q, k, v, g, beta, *masks)
  w, u, a, qs, ks, dec = prep.recurrence
  K = blocks.dims(cfg, w)[-1]
  t = spans.transitions(cfg, w, u, ks, dec)
  A, b = _slice_map(t, K)
  A = A * carries
  entering = _t(entering_states(_t(A), _t(b), _t(h0), carries, axis)[0])
  o, leaving, states, _ = spans.forward(cfg, *prep.recurrence, entering, q.dtype, True, t=t)
  return (o, leaving), (prep, states, t, A)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _context_core(cfg, axis, q, k, v, g, beta, h0, doc_c, doc_r, sees, last, carries):
  masks = (doc_c, doc_r, sees, last)
  return _forward(no_backward(cfg), axis, q, k, v, g, beta, h0, masks, carries)[0]


def _core_fwd(cfg, axis, q, k, v, g, beta, h0, doc_c, doc_r, sees, last, carries):
  masks = (doc_c, doc_r, sees, last)
  outs, saved = _forward(cfg, axis, q, k, v, g, beta, h0, masks, carries)
  return outs, (q, k, v, g, beta, masks, carries, saved)


def _core_bwd(cfg, axis, res, cots):
  q, k, v, g, beta, masks, carries, saved = res
  return (*_backward(cfg, axis, (q, k, v, g, beta), masks, carries, saved, cots),
          *mask_cotangents(masks), jnp.zeros_like(carries))


@lowered_once(0, 1)
def _backward(cfg, axis, inputs, masks, carries, saved, cots):
  """(dq, dk, dv, dg, dbeta, dh0)."""
  prep, states, t, A = saved
  do, d_exit = cots
  w, u, a, qs, ks, dec = prep.recurrence
  own = spans.own_cotangents(cfg, w, a, qs, ks, dec, do)
  # the slice's own cotangent: its spans' own, chained back from a zero one
  E = (own[:, :, 0] if cfg.spans == 1 else
       spans.chain(cfg, t, own, jnp.zeros_like(d_exit), reverse=True)[1])
  d_leaving = _leaving_cotangents(A, E, d_exit, carries, axis)
  dvn, dstates, d_entering = spans.backward(cfg, w, a, qs, ks, dec, do, d_leaving, t, own)
  first = jax.lax.axis_index(axis) == 0
  return (*input_cotangents(cfg, inputs, masks, prep, states, dstates, do, dvn),
          jnp.where(first, d_entering, 0.0))


_context_core.defvjp(_core_fwd, _core_bwd)


def kda_pallas_context(q, k, v, g, beta, *, axis, segment_ids, initial_state=None, scale=None,
                       chunk_size=None, sub_chunk_size=16, interpret=False, platform=None,
                       bounded_gate=True, **tuning):
  """One device's slice inside `shard_map` over `axis`, `kda_pallas`'s kernels (GPU or
  interpret; the TPU kernels have no span transitions). Returns o [B, T, H, V] and the state
  leaving this slice [B, H, K, V] fp32."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  cfg, (*args, h0, doc_c, doc_r, sees, last) = kernel_inputs(
      q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
      chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, interpret=interpret,
      platform=platform, block_v=None, save_states=True, bounded_gate=bounded_gate, **tuning)
  if cfg.platform == "tpu":
    raise ValueError("kda_pallas_context: the TPU kernels walk the chunks on a sequential "
                     "grid axis and have no span transitions; use context.kda_context")
  carries = carries_over(segment_ids, axis)[:, None, None, None]
  o, st = _context_core(cfg, axis, *args, h0, doc_c, doc_r, sees, last, carries)
  return o[:, :T, :, :V], jnp.swapaxes(st, -1, -2)[:, :, :K, :V]

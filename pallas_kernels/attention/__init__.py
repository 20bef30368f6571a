"""Softmax attention with a document mask: `attention` dispatches to "reference" (dense
scores) or "kernel" (`flash.py`, `cudnn.py`); `max_logit.py`: QK-Clip's max logit for the
kernels; `context.py`: the queries split along T."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.context import (context_parallel, flash_tpu_window,
                                              heads_divide, heads_exchanged, kv_spec)
from pallas_kernels.attention.cudnn import cudnn_ready, flash_cudnn, run_slots, segment_runs
from pallas_kernels.attention.flash import flash_gpu, flash_tpu, unique_padding_ids
from pallas_kernels.attention.max_logit import max_logit, max_logit_block, max_logit_gpu
from pallas_kernels.attention.reference import attention_mask, attention_reference
from pallas_kernels.backends import check_backend, deterministic_only
from pallas_kernels.platform import target_platform
from pallas_kernels.shard_types import axis_names

__all__ = ["BACKENDS", "RENAMED", "attention", "attention_mask", "attention_reference",
           "cudnn_ready", "flash_cuda", "flash_cudnn", "flash_gpu", "flash_tpu", "max_logit",
           "max_logit_block", "max_logit_gpu", "run_slots", "segment_runs", "unique_padding_ids"]

BACKENDS = ("reference", "kernel", "auto")
RENAMED = {"dense": "reference", "flash": "kernel"}  # old: new


def _sharded(kernel, q, k, v, ids, *, mesh, batch_axis, head_axis, seq_axis,
             with_logit=False):
  """kernel(q, k, v, q_ids, kv_ids) per device: XLA does not partition a Pallas call."""
  if mesh is None or (batch_axis is None and head_axis is None and seq_axis is None):
    return kernel(q, k, v, ids, ids)
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  tok_q = P(batch_axis, seq_axis, head_axis)
  tok_k, tok_v = (kv_spec(x, batch_axis, head_axis) for x in (k, v))
  row_q, row_kv = P(batch_axis, seq_axis), P(batch_axis, None)

  def body(*args):
    if not with_logit:
      return kernel(*args)
    out, logit = kernel(*args)
    return out, jax.lax.pmax(logit, axis_names(batch_axis, seq_axis))

  # check_vma=False: pallas_call's outputs carry no varying-axes annotation.
  return jax.shard_map(body, mesh=mesh, in_specs=(tok_q, tok_k, tok_v, row_q, row_kv),
                       out_specs=(tok_q, P(head_axis)) if with_logit else tok_q,
                       check_vma=False)(q, k, v, ids, ids)


def flash_cuda(q, k, v, ids, *, scale, causal):
  """The GPU kernel, chosen per batch at run time: cuDNN unpacked, cuDNN packed, or Triton;
  Triton alone inside `backends.deterministic()`."""
  triton = functools.partial(flash_gpu, ids=ids, scale=scale, causal=causal)
  if not cudnn_ready() or deterministic_only():
    return triton(q, k, v)
  segments = jnp.maximum(ids, 0)
  slots = run_slots(*q.shape)
  offsets, _, runs = segment_runs(segments, slots)
  single = jnp.all((runs == 0) | ((runs == 1) & (offsets[:, 0] == 0)))
  cudnn = functools.partial(flash_cudnn, segment_ids=segments, scale=scale, causal=causal)
  branch = jnp.where(single, 0, jnp.where(jnp.all(runs <= slots), 1, 2))
  return jax.lax.switch(branch, [functools.partial(cudnn, slots=1),
                                 functools.partial(cudnn, slots=slots), triton], q, k, v)


def attention(q, k, v, segment_ids, *, scale, causal, backend="auto", return_max_logit=False,
              mesh=None, batch_axis=None, head_axis=None, seq_axis=None, platform=None):
  """softmax(scale q k^T, `attention_mask`) v: q [B, T, H, Dqk], k [B, T, H or 1, Dqk],
  v [B, T, H or 1, Dv], segment_ids [B, T] (0 = padding) -> [B, T, H, Dv] in v's dtype, and
  with return_max_logit each head's max logit [H] fp32. backend "kernel": splash on TPU,
  cuDNN or Triton on GPU, splash interpreted elsewhere; "auto": the kernel on TPU and GPU.
  seq_axis splits T (`context.py`): the kernels take all T of a c-th of each device's heads
  where they divide; else splash its query rows, the GPU kernels all T of all its heads.
  The platform (`platform`, else the mesh's devices', else the default backend's) picks the
  kernels when tracing; on a CPU each platform's are traced and chosen when lowering."""
  check_backend("attention", backend, BACKENDS, RENAMED)
  where = dict(return_max_logit=return_max_logit, mesh=mesh, batch_axis=batch_axis,
               head_axis=head_axis, seq_axis=seq_axis)
  split = causal and mesh is not None and seq_axis is not None

  def reference_local(q, k, v, ids, q_offset):
    return attention_reference(q, k, v, ids, scale=scale, causal=True, q_offset=q_offset)

  def reference(q, k, v):
    if split:
      return context_parallel(reference_local, q, k, v, segment_ids, **where)
    out, logit_max = attention_reference(q, k, v, segment_ids, scale=scale, causal=causal)
    return (out, logit_max) if return_max_logit else out

  if backend == "reference":
    return reference(q, k, v)
  if v.shape[2] > 1:   # splash's multi-query form needs k and v shared; else one per head
    k = _per_head(k, q.shape[2])
  kernels = _Kernels(segment_ids, scale=scale, causal=causal, **where)
  # Only the target's kernels: splash builds its mask tables while tracing, in time that grows
  # with (T / block)^2, which a GPU program would pay for nothing.
  target = target_platform(mesh, platform)
  if target == "gpu":
    return kernels.cuda(q, k, v)
  if target == "tpu":
    return kernels.tpu(interpret=False)(q, k, v)
  forced = backend == "kernel"
  return jax.lax.platform_dependent(
      q, k, v, tpu=kernels.tpu(interpret=False), cuda=kernels.cuda,
      default=kernels.tpu(interpret=True) if forced else reference)


def _per_head(x, heads):
  return jnp.broadcast_to(x, (*x.shape[:2], heads, x.shape[3]))


class _Kernels:
  """`attention`'s kernel paths: (q, k, v) -> out, or (out, max logit)."""

  def __init__(self, segment_ids, *, scale, causal, return_max_logit, mesh, batch_axis,
               head_axis, seq_axis):
    self.segment_ids, self.ids = segment_ids, unique_padding_ids(segment_ids)
    self.scale, self.causal, self.with_logit = scale, causal, return_max_logit
    self.mesh, self.seq_axis = mesh, seq_axis
    self.where = dict(return_max_logit=return_max_logit, mesh=mesh, batch_axis=batch_axis,
                      head_axis=head_axis, seq_axis=seq_axis)
    self.shard = functools.partial(_sharded, mesh=mesh, batch_axis=batch_axis,
                                   head_axis=head_axis)

  def _exchange(self, q) -> bool:
    return (self.mesh is not None and self.seq_axis is not None
            and heads_divide(q, self.mesh, self.where["head_axis"], self.seq_axis))

  def _logit(self, kernel, q, k, ids, **kw):
    if not self.with_logit:
      return None
    return kernel(q, k, jnp.maximum(ids, 0), scale=self.scale, causal=self.causal, **kw)

  def tpu(self, interpret):
    """Splash: all T of H/c heads, or each device's query rows after the others' keys."""
    def local(q, k, v, ids):   # the unique padding ids: no query sees another's
      out = flash_tpu(q, k, v, ids, ids, scale=self.scale, causal=self.causal,
                      interpret=interpret)
      return out, self._logit(max_logit, q, k, ids)

    def window(q, k, v, ids, q_offset):
      out = flash_tpu_window(q, k, v, ids, q_offset, scale=self.scale, interpret=interpret)
      return out, self._logit(max_logit, q, k, ids, q_offset=q_offset)

    def run(q, k, v):
      if self._exchange(q):
        return heads_exchanged(local, q, k, v, self.ids, **self.where)
      if self.causal and self.mesh is not None and self.seq_axis is not None:
        return context_parallel(window, q, k, v, self.segment_ids, **self.where)
      kernel = functools.partial(flash_tpu, scale=self.scale, causal=self.causal,
                                 interpret=interpret)
      out = self.shard(kernel, q, k, v, self.ids, seq_axis=self.seq_axis)
      if not self.with_logit:
        return out
      return out, max_logit(q, k, self.segment_ids, scale=self.scale, causal=self.causal)
    return run

  def _gpu(self, q, k, v, ids):
    heads = q.shape[2]
    out = flash_cuda(q, _per_head(k, heads), _per_head(v, heads), ids, scale=self.scale,
                     causal=self.causal)
    return out, self._logit(max_logit_gpu, q, k, ids)

  def cuda(self, q, k, v):
    """cuDNN or Triton (no query offset): all T of H/c heads, or of all heads."""
    if self._exchange(q):
      return heads_exchanged(self._gpu, q, k, v, self.ids, **self.where)

    def gathered(q, k, v, ids, _):
      out, logit = self._gpu(q, k, v, ids)
      return (out, logit) if self.with_logit else out
    return self.shard(gathered, q, k, v, self.ids, seq_axis=None, with_logit=self.with_logit)

"""Routed-expert dispatch of Stable LatentMoE (K3_SPEC 4): latent z + routing -> u.

  "dropless" (`dropless_moe`): the (token, slot) pairs are sorted by expert and the experts
      run as grouped matmuls (`pallas_kernels.grouped_matmul`: `jax.lax.ragged_dot`, or
      Mosaic GPU kernels on GPU, `moe.gmm_backend`); nothing is dropped.
  "capacity" (`capacity_moe`): each expert gets a fixed buffer of `capacity` pairs per
      sequence, buffers [E, rows, C, L], and runs as one batched matmul; pairs beyond a
      buffer are dropped, later positions first.

Both take the expert computation as a function (`ExpertsFn`, `BufferExpertsFn`): the
piece that `expert_parallel` wraps in an all-to-all. Shapes: N tokens (rows * T, row-major),
k slots per token, E experts, L latent width, H expert hidden width, C capacity.

"auto" is one of the other dispatches, picked per platform and mesh by the rule that
`resolve_dispatch` states.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul, resolve_backend
from pallas_kernels.shard_types import cotangent_like

DISPATCHES = ("dropless", "capacity", "expert_parallel", "expert_parallel_dropless",
              "auto")  # moe.dispatch; the expert_parallel ones: expert_parallel.py
ExpertsFn = Callable[[jax.Array, jax.Array], jax.Array]
BufferExpertsFn = Callable[[jax.Array], jax.Array]


def resolve_dispatch(dispatch: str, platform: str, grouped_kernel: bool = False,
                     experts_split: bool = False) -> str:
  """`dispatch` (one of DISPATCHES) with "auto" made concrete for `platform`, what the
  program is compiled for ("tpu", "gpu", "cpu": `pallas_kernels.platform.target_platform`);
  the other names are returned as they are. The rule of "auto":

  - TPU: "expert_parallel_dropless", the dropless dispatch per device. XLA compiles
    `ragged_dot` to grouped-matmul kernels there (`ragged-dot-*` TPU custom calls;
    tests/test_aot.py compiles the layer for v5p), and under jit alone it would run the
    sorted rows of plain "dropless" unpartitioned: every data-parallel device would compute
    every token's experts.
  - GPU, where the experts' grouped matmuls run as the Mosaic GPU kernel (grouped_kernel:
    `grouped_kernel_fits`) and every device holds all experts (not experts_split): the
    same (k3_small's train step is faster than with capacity,
    benchmarks/results/train_step.md).
  - Elsewhere "capacity": on CPU, where `ragged_dot` runs every expert densely; on GPU
    where the kernel's tiles do not fit (XLA's `ragged_dot` there runs far below the matmul
    rate: benchmarks/results/moe.md) or the experts are split over devices: XLA's GPU
    ragged all-to-all is unmeasured here and has open problems in JAX 0.11
    (openxla/xla#33386: a small fraction of NVLink bandwidth on one host; #47283: crashes
    above 32 ranks).
  """
  if dispatch not in DISPATCHES:
    raise ValueError(f"moe.dispatch must be one of {DISPATCHES}, got {dispatch!r}")
  if dispatch != "auto":
    return dispatch
  if platform == "tpu" or (platform == "gpu" and grouped_kernel and not experts_split):
    return "expert_parallel_dropless"
  return "capacity"


def grouped_kernel_fits(rows: int, latent: int, hidden: int, num_experts: int, dtype,
                        backend: str = "auto") -> bool:
  """Whether the dropless experts' grouped matmuls on a GPU, rows [rows, latent] sorted by
  expert times [E, latent, hidden] and back, run as the kernel under `backend`
  (`moe.gmm_backend`): on 16-bit operands whose sizes divide its tiles."""
  sd = jax.ShapeDtypeStruct
  return all(resolve_backend(backend, "gpu", sd((rows, a), dtype),
                             sd((num_experts, a, b), dtype)) != "reference"
             for a, b in ((latent, hidden), (hidden, latent)))


def dropless_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, experts: ExpertsFn,
                 num_experts: int, token_chunk: int = 0) -> jax.Array:
  """u = sum_k weights[:, k] * experts(z)[token, idx[:, k]] without dropping tokens.

  z: [N, L]; idx: [N, k] int32; weights: [N, k] fp32. `experts(rows, group_sizes)` maps
  rows [N*k, L] sorted by expert (group_sizes [E] rows per expert, in expert order) to
  [N*k, L]. Returns u [N, L] fp32. The sorted rows are the capacity dispatch's buffer with
  one slot per pair, so both directions are the same gather-only custom VJPs.

  token_chunk (`moe.token_chunk`, 0: all N at once): dispatch that many tokens at a time
  in a loop whose steps are rematerialized, so the experts' activations ([token_chunk * k,
  H] fp32 and the sorted rows) exist for one chunk at a time, whatever N. Each token's u
  is the same either way (the dispatch is per token); only the order of the experts'
  weight-gradient sums changes.
  """
  n, k = idx.shape
  if token_chunk and token_chunk < n:
    if n % token_chunk:
      raise ValueError(f"moe.token_chunk={token_chunk} does not divide the {n} tokens a "
                       "device dispatches (rows x positions on it)")
    c = n // token_chunk
    step = jax.checkpoint(lambda a: _dropless(*a, experts, num_experts), prevent_cse=False)
    u = jax.lax.map(step, (z.reshape(c, token_chunk, -1), idx.reshape(c, token_chunk, k),
                           weights.reshape(c, token_chunk, k)))
    return u.reshape(n, -1)
  return _dropless(z, idx, weights, experts, num_experts)


def _dropless(z, idx, weights, experts, num_experts):
  """`dropless_moe` on all of its tokens at once."""
  n, k = idx.shape
  flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [N*k] the pair at each row
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  row = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32))  # of a pair
  out_sorted = experts(_dispatch(z, order, row.reshape(n, k)), group_sizes)  # [N*k, L]
  return _combine(out_sorted, weights, row.reshape(n, k), order)


def _rank_in_expert(flat: jax.Array, num_experts: int) -> jax.Array:
  """[M] position of each pair among the pairs of its group (expert), in pair order."""
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts)
  starts = jnp.cumsum(sizes) - sizes  # [E] first sorted position of each expert
  rank_sorted = jnp.arange(flat.shape[0]) - starts[flat[order]]
  return jnp.zeros_like(flat).at[order].set(rank_sorted.astype(flat.dtype))


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[index] along axis 0; an out-of-range index gives a zero row."""
  return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


# Both directions of the capacity dispatch are row gathers: the transpose of "buffer slot s
# takes token src[s]" is "token t sums the slots of its k pairs", again a gather (of k rows),
# never a scatter-add. XLA's autodiff of a gather is a scatter-add, several times slower
# on GPU, hence the custom VJPs.

@jax.custom_vjp
def _dispatch(z: jax.Array, src: jax.Array, slot: jax.Array) -> jax.Array:
  """buf [S, L] with buf[s] = z[src[s] // k] (zero where src[s] = N * k: an empty slot).

  z: [N, L]; src: [S] int32 pair of each slot; slot: [N, k] int32 slot of each pair (S if
  dropped), the inverse map, used by the backward.
  """
  return _gather_rows(z, src // slot.shape[1])


def _dispatch_fwd(z, src, slot):
  return _dispatch(z, src, slot), (slot, z[:0, 0])


def _dispatch_bwd(res, dbuf):
  slot, z_type = res  # z_type: an empty array with z's dtype and shard_map type
  n, k = slot.shape
  dz = _gather_rows(dbuf, slot.reshape(-1)).reshape(n, k, -1)
  dz = jnp.sum(dz.astype(jnp.float32), axis=1).astype(z_type.dtype)
  return cotangent_like(dz, z_type), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(out: jax.Array, weights: jax.Array, slot: jax.Array, src: jax.Array) -> jax.Array:
  """u [N, L] fp32 = sum_j weights[:, j] * out[slot[:, j]] (a dropped pair adds nothing).

  out: [S, L] expert outputs per slot; weights: [N, k] fp32; slot: [N, k] int32; src: [S]
  int32 (N * k where empty), the inverse map, used by the backward.
  """
  n, k = slot.shape
  pairs = _gather_rows(out, slot.reshape(-1)).reshape(n, k, -1)
  return jnp.einsum("nk,nkl->nl", weights.astype(jnp.float32), pairs.astype(jnp.float32))


def _combine_fwd(out, weights, slot, src):
  return _combine(out, weights, slot, src), (out, weights, slot, src)


def _combine_bwd(res, du):
  out, weights, slot, src = res
  n, k = slot.shape
  # slot s holds pair src[s] = (token src // k, slot j): d out[s] = weights[pair] * du[token]
  w_slot = _gather_rows(weights.reshape(-1), src)  # [S]; 0 for empty slots
  dout = (_gather_rows(du, src // k) * w_slot[:, None]).astype(out.dtype)
  pairs = _gather_rows(out, slot.reshape(-1)).reshape(n, k, -1)
  dweights = jnp.einsum("nl,nkl->nk", du, pairs.astype(jnp.float32)).astype(weights.dtype)
  return cotangent_like(dout, out), cotangent_like(dweights, weights), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def capacity_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, experts: BufferExpertsFn,
                 num_experts: int, num_rows: int, capacity: int):
  """Fixed-buffer dispatch: u = sum_k weights * E_idx(z) over the pairs that fit.

  z: [N, L] with N = num_rows * T tokens, row-major; idx, weights: [N, k]. Each expert
  takes at most `capacity` pairs from each row, earlier positions first, so whether a
  token is dropped depends only on earlier tokens of its own sequence: dispatch stays
  causal and rows never affect each other. `experts` maps the buffers [E, rows, C, L]
  (z's dtype; empty slots are zero) to outputs of the same shape.
  Returns (u [N, L] fp32, kept [N, k] bool).
  """
  n, k = idx.shape
  slots = num_rows * num_experts * capacity
  row = jnp.arange(n * k) // (n // num_rows * k)  # [N*k] sequence of each pair
  group = row * num_experts + idx.reshape(-1)  # [N*k] (row, expert) buffer of each pair
  rank = _rank_in_expert(group, num_rows * num_experts)
  kept = rank < capacity
  slot = jnp.where(kept, group * capacity + rank, slots).astype(jnp.int32)  # S: dropped
  src = jnp.full((slots,), n * k, jnp.int32).at[slot].set(  # N * k: an empty slot
      jnp.arange(n * k, dtype=jnp.int32), mode="drop", unique_indices=True)
  slot = slot.reshape(n, k)
  buf = _dispatch(z, src, slot)  # [rows * E * C, L], slots ordered (row, expert, rank)
  buf = buf.reshape(num_rows, num_experts, capacity, -1).swapaxes(0, 1)  # [E, rows, C, L]
  out = experts(buf).swapaxes(0, 1).reshape(slots, -1)
  return _combine(out, weights, slot, src), kept.reshape(n, k)


def ragged_glu_experts(w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act, dtype,
                       backend: str = "auto", platform: str | None = None) -> ExpertsFn:
  """Grouped GLU experts: rows [M, L] sorted by expert -> [M, L] in `dtype`.

  w_g, w_u: [E, L, H]; w_d: [E, H, L]; act: the fp32 GLU activation (g, v) -> h. backend,
  platform: of the grouped matmuls (`pallas_kernels.grouped_matmul`, `moe.gmm_backend`).
  """
  def gmm(x, w, sizes):
    return grouped_matmul(x, w.astype(dtype), sizes, backend=backend, platform=platform)

  @jax.named_scope("experts")
  def run(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = rows.astype(dtype)
    g = gmm(rows, w_g, group_sizes)  # [M, H]
    v = gmm(rows, w_u, group_sizes)  # [M, H]
    return gmm(act(g, v).astype(dtype), w_d, group_sizes)  # [M, L]
  return run


def batched_glu_experts(w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act,
                        dtype) -> BufferExpertsFn:
  """GLU experts on buffers: [E, R, C, L] -> [E, R, C, L] in `dtype`, one batched matmul each.

  w_g, w_u: [E, L, H]; w_d: [E, H, L]; act: the fp32 GLU activation (g, v) -> h. With H
  split across devices (w_g, w_u, w_d holding a slice of it) the result is this slice's
  partial sum of the output.
  """
  @jax.named_scope("experts")
  def run(buf: jax.Array) -> jax.Array:
    buf = buf.astype(dtype)
    # (gate and up as one matmul on concatenated weights was slower on the H200:
    # benchmarks/results/moe.md)
    g = jnp.einsum("erck,ekh->erch", buf, w_g.astype(dtype))
    v = jnp.einsum("erck,ekh->erch", buf, w_u.astype(dtype))
    return jnp.einsum("erch,ehk->erck", act(g, v).astype(dtype), w_d.astype(dtype))
  return run

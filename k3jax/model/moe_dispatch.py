"""Routed-expert dispatch of Stable LatentMoE (K3_SPEC 4): latent z + routing -> u.

"dropless" (`dropless_moe`): pairs sorted by expert, grouped matmuls, nothing dropped;
"capacity" (`capacity_moe`): buffers [E, rows, C, L], overflow dropped, later positions first.
Experts are functions (`ExpertsFn`, `BufferExpertsFn`) that `expert_parallel` wraps in an
all-to-all. N tokens, k slots, E experts, L latent, H hidden, C capacity."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax.model.remat import keep
from pallas_kernels.grouped_matmul import grouped_matmul, resolve_backend
from pallas_kernels.shard_types import cotangent_like

DISPATCHES = ("dropless", "capacity", "expert_parallel", "expert_parallel_dropless",
              "auto")  # moe.dispatch; the expert_parallel ones: expert_parallel.py
ExpertsFn = Callable[[jax.Array, jax.Array], jax.Array]
BufferExpertsFn = Callable[[jax.Array], jax.Array]


def resolve_dispatch(dispatch: str, platform: str, grouped_kernel: bool = False,
                     experts_split: bool = False) -> str:
  """`dispatch` with "auto" made concrete for `platform` ("tpu", "gpu", "cpu").
  "auto": "expert_parallel_dropless" on TPU (plain "dropless" under jit would run the
  sorted rows unpartitioned), and on GPU when the Mosaic grouped kernel fits and experts
  are not split; "capacity" elsewhere (CPU runs `ragged_dot` densely; GPU ragged
  all-to-all: openxla/xla#33386, #47283). See benchmarks/results/moe.md."""
  if dispatch not in DISPATCHES:
    raise ValueError(f"moe.dispatch must be one of {DISPATCHES}, got {dispatch!r}")
  if dispatch != "auto":
    return dispatch
  if platform == "tpu" or (platform == "gpu" and grouped_kernel and not experts_split):
    return "expert_parallel_dropless"
  return "capacity"


def grouped_kernel_fits(rows: int, latent: int, hidden: int, num_experts: int, dtype,
                        backend: str = "auto") -> bool:
  """Whether the GPU grouped matmuls run as the kernel under `backend`."""
  sd = jax.ShapeDtypeStruct
  return all(resolve_backend(backend, "gpu", sd((rows, a), dtype),
                             sd((num_experts, a, b), dtype)) != "reference"
             for a, b in ((latent, hidden), (hidden, latent)))


def dropless_moe(z: jax.Array, idx: jax.Array, weights: jax.Array, experts: ExpertsFn,
                 num_experts: int, token_chunk: int = 0) -> jax.Array:
  """u = sum_k weights[:, k] * experts(z)[token, idx[:, k]] without dropping tokens.
  z: [N, L]; idx, weights: [N, k]; `experts(rows [N*k, L] sorted by expert, group_sizes
  [E])` -> [N*k, L]. Returns u [N, L] fp32. token_chunk > 0: that many tokens per
  rematerialized loop step, bounding the experts' activations; u is unchanged."""
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
  n, k = idx.shape
  flat = idx.reshape(-1)  # [N*k] expert of each (token, slot)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [N*k] the pair at each row
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  row = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32),
                                            unique_indices=True)  # a permutation's inverse
  order, group_sizes, row = (keep("moe_experts", a) for a in (order, group_sizes, row))
  rows = keep("moe_experts", _dispatch(z, order, row.reshape(n, k)))  # [N*k, L]
  out_sorted = keep("moe_experts", experts(rows, group_sizes))  # [N*k, L]
  return _combine(out_sorted, weights, row.reshape(n, k), order)


def _rank_in_expert(flat: jax.Array, num_experts: int) -> jax.Array:
  """[M] position of each pair among the pairs of its group (expert), in pair order."""
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts)
  starts = jnp.cumsum(sizes) - sizes  # [E] first sorted position of each expert
  rank_sorted = jnp.arange(flat.shape[0]) - starts[flat[order]]
  return jnp.zeros_like(flat).at[order].set(rank_sorted.astype(flat.dtype), unique_indices=True)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[index] along axis 0; an out-of-range index gives a zero row."""
  return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


# Custom VJPs keep both directions as row gathers; autodiff would give scatter-adds.

@jax.custom_vjp
def _dispatch(z: jax.Array, src: jax.Array, slot: jax.Array) -> jax.Array:
  """buf [S, L] = z[src // k] (zero for empty slots, src = N * k); slot [N, k] is the
  inverse map (S if dropped), for the backward."""
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
  """u [N, L] fp32 = sum_j weights[:, j] * out[slot[:, j]]; out: [S, L]; src: [S] the
  inverse map, for the backward."""
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
  z: [N, L], N = num_rows * T; idx, weights: [N, k]. At most `capacity` pairs per expert
  per row, earlier positions first, so dropping stays causal. `experts`: [E, rows, C, L]
  -> same. Returns (u [N, L] fp32, kept [N, k] bool)."""
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
  """Grouped GLU experts: rows [M, L] sorted by expert -> [M, L] in `dtype`."""
  def gmm(x, w, sizes):
    return grouped_matmul(x, w.astype(dtype), sizes, backend=backend, platform=platform)

  @jax.named_scope("experts")
  def run(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = rows.astype(dtype)
    g = keep("moe_experts", gmm(rows, w_g, group_sizes))  # [M, H]
    v = keep("moe_experts", gmm(rows, w_u, group_sizes))  # [M, H]
    return gmm(act(g, v).astype(dtype), w_d, group_sizes)  # [M, L]
  return run


def batched_glu_experts(w_g: jax.Array, w_u: jax.Array, w_d: jax.Array, act,
                        dtype) -> BufferExpertsFn:
  """GLU experts on buffers: [E, R, C, L] -> [E, R, C, L] in `dtype`, one batched matmul each.
  w_g, w_u: [E, L, H]; w_d: [E, H, L]; act: fp32 (g, v) -> h. With H split across
  devices the result is this slice's partial sum."""
  @jax.named_scope("experts")
  def run(buf: jax.Array) -> jax.Array:
    buf = buf.astype(dtype)
    g = jnp.einsum("erck,ekh->erch", buf, w_g.astype(dtype))
    v = jnp.einsum("erck,ekh->erch", buf, w_u.astype(dtype))
    return jnp.einsum("erch,ehk->erck", act(g, v).astype(dtype), w_d.astype(dtype))
  return run

"""Analytic training FLOPs per token, MFU, and the peak FLOP/s of known accelerators.

`flops_per_token(cfg.model, seq_len)`: forward matmul FLOPs per token and component:

  lm_head     2 d V (the embedding lookup: 0)
  kda_proj    5 * 2 d H K + 2 d H + 2 (d r + r H K) + 3 * 2 c H K
  kda_core    per head, chunk C, triangles halved: 6 K V + C (3 K + 2 V) + C^2 / 3
  mla_proj    2 (d q_r + q_r H (n + p) + d (kv_r + p) + kv_r H (n + v) + 2 d H v)
  mla_core    (T + 1) H (n + p + v) (causal: (T + 1) / 2 keys on average)
  dense_ffn   3 * 2 d F;  moe_router 2 d E;  moe_latent 2 * 2 d L
  moe_routed  top_k * 3 * 2 L F_e;  moe_shared num_shared * 3 * 2 d F_s
  attn_res    2 * 2 d S per sublayer with S sources

`train = 3 * forward` (no remat, no elementwise work); `dense_proj` = 2 N_active."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from pallas_kernels import kda as kda_ops

COMPONENTS = ("embedding", "lm_head", "kda_proj", "kda_core", "mla_proj", "mla_core",
              "dense_ffn", "moe_router", "moe_latent", "moe_routed", "moe_shared",
              "attn_res")
CORES = ("kda_core", "mla_core", "attn_res")


def layer_kinds(m: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """(mixer, ffn) per layer: mixer "mla"/"kda", ffn "dense"/"moe" (cfg.model rules)."""
  kinds = []
  for i in range(1, m.num_layers + 1):
    mla = i % m.mla_every == 0 or (m.final_mla and i == m.num_layers)
    kinds.append(("mla" if mla else "kda", "dense" if i <= m.dense_layers else "moe"))
  return kinds


def kda_core_flops_per_head(k: int, v: int, chunk: int) -> float:
  """Chunked KDA forward FLOPs per token and head (module docstring)."""
  return 6 * k * v + chunk * (3 * k + 2 * v) + chunk * chunk / 3


def attn_res_sources(num_layers: int, block_layers: int) -> list[int]:
  """Number of sources each AttnRes reads: 2 per layer (mixer, FFN), then the output."""
  sources = []
  for j in range(2 * num_layers):
    block = (j // 2) // block_layers
    first_in_block = j == 2 * block * block_layers
    sources.append(1 + block + (0 if first_in_block else 1))
  num_blocks = -(-num_layers // block_layers)
  sources.append(1 + num_blocks)
  return sources


def flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> dict[str, float]:
  """Forward FLOPs per token by component, plus "forward", "dense_proj" and "train"."""
  d = m.d_model
  f = dict.fromkeys(COMPONENTS, 0.0)
  f["lm_head"] = 2 * d * m.vocab_size
  k, a, e = m.kda, m.mla, m.moe
  hk = k.num_heads * k.head_dim
  # chunk_size 0: this process's platform default (64 on CPU, as on TPU)
  chunk = k.chunk_size or kda_ops.default_chunk_size(k.backend, jax.default_backend())
  for mixer, ffn in layer_kinds(m):
    if mixer == "kda":
      f["kda_proj"] += (5 * 2 * d * hk + 2 * d * k.num_heads
                        + 2 * (d * k.gate_rank + k.gate_rank * hk) + 3 * 2 * k.conv_size * hk)
      f["kda_core"] += k.num_heads * kda_core_flops_per_head(k.head_dim, k.head_dim, chunk)
    else:
      qk = a.qk_nope_dim + a.qk_rope_dim
      f["mla_proj"] += 2 * (d * a.q_lora_rank + a.q_lora_rank * a.num_heads * qk
                            + d * (a.kv_lora_rank + a.qk_rope_dim)
                            + a.kv_lora_rank * a.num_heads * (a.qk_nope_dim + a.v_head_dim)
                            + 2 * d * a.num_heads * a.v_head_dim)
      f["mla_core"] += (seq_len + 1) * a.num_heads * (qk + a.v_head_dim)
    if ffn == "dense":
      f["dense_ffn"] += 3 * 2 * d * m.ffn.hidden_dim
    else:
      f["moe_router"] += 2 * d * e.num_experts
      f["moe_latent"] += 2 * 2 * d * e.latent_dim
      f["moe_routed"] += e.top_k * 3 * 2 * e.latent_dim * e.expert_dim
      f["moe_shared"] += e.num_shared * 3 * 2 * d * e.shared_dim
  if m.attn_res.enabled:
    f["attn_res"] = sum(4 * d * s for s in attn_res_sources(m.num_layers,
                                                           m.attn_res.block_layers))
  f = {name: float(v) for name, v in f.items()}
  f["forward"] = sum(f[c] for c in COMPONENTS)
  f["dense_proj"] = f["forward"] - sum(f[c] for c in CORES)
  f["train"] = 3 * f["forward"]
  return f


def format_breakdown(f: dict[str, float]) -> str:
  """One line per component: FLOPs per token and share of the forward pass."""
  lines = [f"{'component':<12} {'fwd FLOPs/token':>16} {'share':>7}"]
  for name in COMPONENTS:
    lines.append(f"{name:<12} {f[name]:>16.4e} {f[name] / f['forward']:>7.2%}")
  for name in ("forward", "dense_proj", "train"):
    lines.append(f"{name:<12} {f[name]:>16.4e}")
  return "\n".join(lines)


def mfu(tokens_per_sec_per_device: float, flops_per_token: float,
        peak_flops_per_device: float) -> float:
  """Achieved training FLOP/s (from `flops_per_token(...)["train"]`) over the peak."""
  if not peak_flops_per_device or peak_flops_per_device <= 0:
    raise ValueError(f"mfu: peak_flops_per_device must be positive, "
                     f"got {peak_flops_per_device}")
  return tokens_per_sec_per_device * flops_per_token / peak_flops_per_device


# Dense bf16 peak FLOP/s per JAX device, matched in order against device_kind (lowercase).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100", 989e12),
    ("h200", 989e12),
    ("h800", 989e12),
    ("a100", 312e12),
    ("v5 lite", 197e12),   # TPU v5e reports "TPU v5 lite"
    ("v5e", 197e12),
    ("v5p", 459e12),
    ("v5", 459e12),        # TPU v5p reports "TPU v5"
    ("v6 lite", 918e12),   # TPU v6e (Trillium) reports "TPU v6 lite"
    ("v6e", 918e12),
    # Ironwood: a chip is two JAX devices
    ("tpu7x", 2307e12 / 2),
    ("ironwood", 2307e12 / 2),
    ("v4", 275e12),
)


def peak_flops(device: Any) -> float | None:
  """Dense bf16 peak FLOP/s of a device or device_kind; None if unknown."""
  if isinstance(device, str):
    kind, platform = device, ""
  else:
    kind, platform = getattr(device, "device_kind", ""), getattr(device, "platform", "")
  kind = kind.lower()
  if platform == "cpu" or "cpu" in kind:
    return None
  for key, value in PEAK_FLOPS:
    if key in kind:
      return value
  return None

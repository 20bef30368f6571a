"""Analytic training FLOPs per token, MFU, and the peak FLOP/s of known accelerators.

`flops_per_token(cfg.model, seq_len)` counts forward matmul FLOPs per token (2 per
multiply-add), summed over all layers, per component:

  lm_head     2 d V                              (the input embedding is a lookup: 0)
  kda_proj    per KDA layer: q, k, v, output gate g, o: 5 * 2 d H K;  beta: 2 d H;
              low-rank decay: 2 (d r + r H K);  depthwise short conv: 3 * 2 c H K
  kda_core    per KDA layer and head, chunkwise form with chunk C (K = d_k, V = d_v);
              causal/triangular products count their lower half:
                A_kk = (K e^G)(K e^-G)^T, strictly lower      C K
                A_qk = (Q e^G)(K e^-G)^T, causal              C K
                (I + A_kk)^-1, unit lower triangular          C^2 / 3
                w = A_kk (beta K e^G), u = A_kk (beta V)      C K + C V
                v_new = u - w S                               2 K V
                o = (Q e^G) S + A_qk v_new                    2 K V + C V
                S <- e^g S + (K e^..)^T v_new                 2 K V
              = 6 K V + C (3 K + 2 V) + C^2 / 3  per token per head
  mla_proj    per MLA layer: W_qa 2 d q_r; W_qb 2 q_r H (n + p); W_kva 2 d (kv_r + p);
              W_kvb 2 kv_r H (n + v); output gate 2 d H v; W_o 2 H v d
  mla_core    per MLA layer: causal softmax attention over T positions; a token attends
              to (T + 1) / 2 keys on average: scores 2 H (n + p) and values 2 H v per key,
              = (T + 1) H (n + p + v)
  dense_ffn   per dense layer, GLU: 3 * 2 d F
  moe_router  2 d E;  moe_latent: W_down + W_up, 2 * 2 d L;
  moe_routed  top_k * 3 * 2 L F_e;  moe_shared: num_shared * 3 * 2 d F_s
  attn_res    per sublayer with S sources: scores and the weighted sum, 2 * 2 d S (plus the
              output-level AttnRes); S = embedding + completed blocks (+ the current
              block's partial sum after its first sublayer)

Elementwise work (norms, activations, gates, softmax, the decay exponentials) is not
counted. `forward` is the sum, `train = 3 * forward` (the backward pass is two matmuls per
forward matmul; rematerialization is not counted, as is usual for MFU).
`dense_proj` = forward without the attention cores (kda_core, mla_core) and AttnRes, which
is 2 * (active matmul parameters incl. the LM head), i.e. 6 N_active for training.
"""

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
  # chunk_size 0: the backend's default on this process's platform (a TPU compile from a
  # CPU host counts the CPU's 64, which is also the TPU's)
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
  """Model FLOPs utilization: achieved training FLOP/s over the device peak.

  `flops_per_token` is the training count (`flops_per_token(...)["train"]`).
  """
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
    # Ironwood: 2,307 TFLOP/s bf16 per chip, and a chip is two JAX devices (one per die,
    # as memory.py counts its HBM)
    ("tpu7x", 2307e12 / 2),
    ("ironwood", 2307e12 / 2),
    ("v4", 275e12),
)


def peak_flops(device: Any) -> float | None:
  """Dense bf16 peak FLOP/s of a `jax.Device` (or a device_kind string); None if unknown
  (CPU, or a kind not in `PEAK_FLOPS`)."""
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

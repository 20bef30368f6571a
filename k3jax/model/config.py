"""The `model` section: `model_config()` with the full K3 values (K3_SPEC 1) and
`validate_model`; cross-section checks are `k3jax.config.validate`'s."""

from __future__ import annotations

import ml_collections

from k3jax.config_error import check, check_backend
from k3jax.model.balancing import BALANCINGS
from k3jax.model.moe_dispatch import DISPATCHES
from k3jax.model.remat import POLICIES as REMAT_POLICIES
from k3jax.model.remat import SAVEABLE as REMAT_SAVEABLE
from k3jax.model.remat import parse_save
from pallas_kernels.attention import BACKENDS as ATTENTION_BACKENDS
from pallas_kernels.attention import RENAMED as ATTENTION_RENAMED
from pallas_kernels.attn_res import BACKENDS as ATTN_RES_BACKENDS
from pallas_kernels.grouped_matmul import BACKENDS as GMM_BACKENDS
from pallas_kernels.kda import BACKENDS as KDA_BACKENDS
from pallas_kernels.kda import RENAMED as KDA_RENAMED
from pallas_kernels.short_conv import BACKENDS as CONV_BACKENDS

DTYPES = ("float32", "bfloat16")
MLA_FORMS = ("expanded", "absorbed")  # model.mla.form
EXPERT_QUANTS = ("none", "mxfp4")  # model.moe.expert_quant


def model_config() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.vocab_size = 163_840
  m.d_model = 7_168
  m.num_layers = 93
  m.mla_every = 4        # 1-based layers 4, 8, ... are MLA; the rest KDA
  m.final_mla = True     # the last layer is MLA too, so the last mixer is global
  m.dense_layers = 1     # the first N layers use the dense FFN, the rest LatentMoE
  m.norm_eps = 1e-5       # every RMSNorm and the AttnRes key norms (the release's value)
  m.embed_init_std = 1.0
  m.dtype = "bfloat16"   # compute dtype; parameters are stored in param_dtype
  m.param_dtype = "float32"
  m.remat = "full"       # one of REMAT_POLICIES, applied per scanned cycle
  m.remat_save = ""      # names kept on top of `remat` ("kda_proj,glu_proj"): remat.SAVEABLE
  m.remat_scope = "cycle"  # "cycle": one remat region per cycle; "layer": also per layer
  m.scan_layers = True   # False: the cycles unrolled in Python (AttnRes reads `Slots`)
  m.kda = _kda()
  m.mla = _mla()
  f = m.ffn = ml_collections.ConfigDict()
  f.hidden_dim = 33_792  # dense FFN of the first `dense_layers` layers
  f.activation = "situ_glu"  # or "swiglu" (ablation)
  f.situ_b1 = 4.0
  f.situ_b2 = 25.0
  m.moe = _moe()
  r = m.attn_res = ml_collections.ConfigDict()
  r.enabled = True       # False: the plain residual stream
  r.block_layers = 12
  # Saved per cycle for the backward: "buffer" (sources [slots, B, T, d]) or "partial"
  # (the partial slot [B, T, d]; `attn_res.scan` rebuilds the rest)
  r.scan_saves = "buffer"
  # pallas_kernels.attn_res backend: reference, kernel (GPU), interpret, auto (kernel on GPU)
  r.backend = "auto"
  m.vision = _vision()
  return m


def _kda() -> ml_collections.ConfigDict:
  k = ml_collections.ConfigDict()
  k.num_heads = 96
  k.head_dim = 128       # d_k = d_v
  k.conv_size = 4
  k.gate_rank = 128      # low-rank decay projection d -> rank -> heads*head_dim
  k.gate = "bounded"     # "bounded": lb*sigmoid(exp(A_log)(f+dt_bias)); "softplus": Kimi Linear
  k.gate_lower_bound = -5.0
  # Tokens per chunk; 0: pallas_kernels.kda.default_chunk_size. Outputs do not depend on it.
  k.chunk_size = 0
  # pallas_kernels.kda backend: reference, naive, kernel, interpret, auto (kernel on TPU/GPU)
  k.backend = "auto"
  # pallas_kernels.short_conv backend: reference, kernel (GPU), interpret, auto (kernel on GPU)
  k.conv_backend = "auto"
  return k


def _mla() -> ml_collections.ConfigDict:
  a = ml_collections.ConfigDict()
  a.num_heads = 96
  a.q_lora_rank = 1_536
  a.kv_lora_rank = 512
  a.qk_nope_dim = 128
  a.qk_rope_dim = 64     # NoPE: the "rope" slot is never rotated; one key shared by all heads
  a.v_head_dim = 128
  # pallas_kernels.attention backend: "reference" (dense scores), "kernel" (flash kernels)
  # or "auto" (the kernel on TPU/GPU). The reference by default: splash's Mosaic compile is
  # slow for micro models; accelerator configs: "auto".
  a.attention = "reference"
  # "expanded": per-head keys and values from c_kv; "absorbed": W_kvb folded into queries
  # and outputs so attention reads c_kv directly (long context, where per-head keys won't fit)
  a.form = "expanded"
  return a


def _moe() -> ml_collections.ConfigDict:
  e = ml_collections.ConfigDict()
  e.num_experts = 896
  e.top_k = 16
  e.expert_dim = 3_072
  e.latent_dim = 3_584   # routed experts run in this latent; = d_model for a full-width MoE
  e.num_shared = 2
  e.shared_dim = 3_072
  e.routed_scaling = 1.0
  e.dispatch = "dropless"    # one of DISPATCHES (k3jax.model.moe_dispatch); "auto": per
                             # platform, by resolve_dispatch
  e.capacity_factor = 2.0    # "capacity": rows per expert = factor * tokens * top_k / experts
  # Dropless dispatches: tokens per rematerialized chunk (0: all at once); capacity refuses it
  e.token_chunk = 0
  # pallas_kernels.grouped_matmul backend: auto, reference (ragged_dot), kernel, kernel_ws
  e.gmm_backend = "auto"
  # "mxfp4": routed experts fake-quantized to MXFP4, straight-through (k3jax.model.mxfp4)
  e.expert_quant = "none"
  # "quantile" (K3), "aux_free", "aux_loss" or "none" (k3jax.model.balancing)
  e.balancing = "quantile"
  e.bias_update_speed = 1e-3  # "aux_free": each step b_j += speed * sign(mean load - load_j)
  e.aux_loss_weight = 0.0    # "aux_loss": alpha of the loss added (e.g. 0.01); 0 otherwise
  e.balance_bins = 1_000
  # Cutoff r: "k_plus_1" (spec) or "leave_one_out" (quantile_balancing.solve_bias)
  e.balance_cutoff = "k_plus_1"
  return e


def _vision() -> ml_collections.ConfigDict:
  v = ml_collections.ConfigDict()
  v.enabled = False      # True: K3Model builds the tower (fed by data.images)
  v.num_layers = 27
  v.width = 1_024
  v.num_heads = 12
  v.head_dim = 128       # attention inner width heads * head_dim = 1536
  v.mlp_dim = 4_096
  v.patch_size = 14      # pixels per side of a patch: patches of 14 x 14 x 3
  v.merge = 2            # m x m neighbouring patches are concatenated into one token
  # video: consecutive frames mean-pooled into one token (the release: 4)
  v.temporal_pool = 4
  v.pos_grid = 64        # G: the table's base grid, interpolated bilinearly to each image
  v.max_patches = 16_384  # N: patches in one packed buffer (one per batch row)
  v.max_media = 64       # images / videos in one packed buffer (one batch row)
  # The released tower: 2-D RoPE on q and k (pairs by column and row in turn)
  v.rope_2d = True
  v.rope_theta = 10_000.0
  v.norm_eps = 2.0 ** -7  # the blocks' and the final norm's (the projector's: model.norm_eps)
  # Projector hidden: -1 merge**2 * width (the release), > 0 that wide, 0 one Dense; norm
  # "post" (release) or "pre"; act "gelu" (erf) or "gelu_tanh"
  v.projector_hidden = -1
  v.projector_norm = "post"
  v.projector_act = "gelu"
  v.placeholder_id = 163_605  # the text token the image features replace (Kimi's media placeholder)
  v.attention = "reference"  # pallas_kernels.attention backend, as model.mla.attention
  return v


def validate_model(m: ml_collections.ConfigDict) -> None:
  """ConfigError naming the first impossible setting of the `model` section."""
  check(m.d_model > 0, "model.d_model", f"must be positive, got {m.d_model}")
  check(m.num_layers >= 1, "model.num_layers", f"must be >= 1, got {m.num_layers}")
  check(m.mla_every >= 1, "model.mla_every", f"must be >= 1, got {m.mla_every}")
  check(0 <= m.dense_layers <= m.num_layers, "model.dense_layers",
        f"must be in [0, num_layers={m.num_layers}], got {m.dense_layers}")
  check(m.dense_layers <= m.mla_every, "model.dense_layers",
        f"dense layers must lie in the first hybrid cycle (<= mla_every={m.mla_every})")
  check(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {m.dtype!r}")
  check(m.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}")
  check(m.remat in REMAT_POLICIES, "model.remat",
        f"must be one of {tuple(REMAT_POLICIES)}, got {m.remat!r}")
  unknown = [n for n in parse_save(m.remat_save) if n not in REMAT_SAVEABLE]
  check(not unknown, "model.remat_save",
        f"unknown names {unknown}; known: {', '.join(REMAT_SAVEABLE)}")
  check(m.remat_scope in ("cycle", "layer"), "model.remat_scope",
        f"must be 'cycle' or 'layer', got {m.remat_scope!r}")
  _check_kda(m.kda)
  _check_mla(m)
  check(m.ffn.activation in ("situ_glu", "swiglu"), "model.ffn.activation",
        f"must be 'situ_glu' or 'swiglu', got {m.ffn.activation!r}")
  _check_moe(m)
  r = m.attn_res
  check(r.block_layers >= 1, "model.attn_res.block_layers", "must be >= 1")
  check(r.scan_saves in ("buffer", "partial"), "model.attn_res.scan_saves",
        f"must be 'buffer' or 'partial', got {r.scan_saves!r}")
  check_backend("model.attn_res.backend", r.backend, ATTN_RES_BACKENDS)
  _check_vision(m)


def _check_kda(k: ml_collections.ConfigDict) -> None:
  check(k.num_heads * k.head_dim > 0, "model.kda", "num_heads and head_dim must be positive")
  check(k.gate in ("bounded", "softplus"), "model.kda.gate",
        f"must be 'bounded' or 'softplus', got {k.gate!r}")
  check(k.gate_lower_bound < 0, "model.kda.gate_lower_bound", "must be negative")
  check(k.conv_size >= 1, "model.kda.conv_size", "must be >= 1")
  check(k.chunk_size == 0 or (k.chunk_size >= 16 and not k.chunk_size & (k.chunk_size - 1)),
        "model.kda.chunk_size", f"must be 0 (the backend's default) or a power of two >= 16, "
        f"got {k.chunk_size}")
  check_backend("model.kda.backend", k.backend, KDA_BACKENDS, KDA_RENAMED)
  check_backend("model.kda.conv_backend", k.conv_backend, CONV_BACKENDS)
  check(k.gate_lower_bound >= -5.0 or k.backend == "naive" or k.gate != "bounded",
        "model.kda.gate_lower_bound",
        f"{k.gate_lower_bound} is below -5: 16-token tiles of the chunked form would overflow")


def _check_mla(m: ml_collections.ConfigDict) -> None:
  a = m.mla
  check(a.q_lora_rank <= m.d_model, "model.mla.q_lora_rank",
        f"{a.q_lora_rank} is wider than d_model={m.d_model}")
  check(a.kv_lora_rank <= m.d_model, "model.mla.kv_lora_rank",
        f"{a.kv_lora_rank} is wider than d_model={m.d_model}")
  for field in ("mla", "vision"):
    check_backend(f"model.{field}.attention", m[field].attention, ATTENTION_BACKENDS,
                  ATTENTION_RENAMED)
  check(a.form in MLA_FORMS, "model.mla.form", f"must be one of {MLA_FORMS}, got {a.form!r}")


def _check_moe(m: ml_collections.ConfigDict) -> None:
  e = m.moe
  check(1 <= e.top_k <= e.num_experts, "model.moe.top_k",
        f"must be in [1, num_experts={e.num_experts}], got {e.top_k}")
  check(e.latent_dim <= m.d_model, "model.moe.latent_dim",
        f"latent {e.latent_dim} is wider than the hidden d_model={m.d_model}")
  check(e.balancing in BALANCINGS, "model.moe.balancing",
        f"must be one of {BALANCINGS}, got {e.balancing!r}")
  check(e.bias_update_speed > 0, "model.moe.bias_update_speed",
        f"must be positive, got {e.bias_update_speed}")
  check(e.aux_loss_weight >= 0, "model.moe.aux_loss_weight",
        f"must be >= 0, got {e.aux_loss_weight}")
  check(e.balancing != "aux_loss" or e.aux_loss_weight > 0, "model.moe.aux_loss_weight",
        "balancing 'aux_loss' needs a positive weight (Switch uses 0.01)")
  check(e.balancing == "aux_loss" or e.aux_loss_weight == 0, "model.moe.aux_loss_weight",
        f"{e.aux_loss_weight} weights an auxiliary loss that balancing {e.balancing!r} "
        "does not have: set it to 0, or balancing to 'aux_loss'")
  check(e.balancing != "quantile" or e.top_k < e.num_experts, "model.moe.top_k",
        "quantile balancing needs top_k < num_experts (it reads the (k+1)-th score)")
  check(e.dispatch in DISPATCHES, "model.moe.dispatch",
        f"must be one of {DISPATCHES}, got {e.dispatch!r}")
  check(e.capacity_factor > 0, "model.moe.capacity_factor", "must be positive")
  check(e.token_chunk >= 0, "model.moe.token_chunk", "must be >= 0 (0: all tokens at once)")
  check(not e.token_chunk or e.dispatch not in ("capacity", "expert_parallel"),
        "model.moe.token_chunk", f"needs a dropless dispatch; model.moe.dispatch is "
        f"{e.dispatch!r} (a per-row capacity buffer cannot be chunked)")
  check(e.expert_quant in EXPERT_QUANTS, "model.moe.expert_quant",
        f"must be one of {EXPERT_QUANTS}, got {e.expert_quant!r}")
  check(e.expert_quant == "none" or (e.latent_dim % 32 == 0 and e.expert_dim % 32 == 0),
        "model.moe.expert_quant", f"mxfp4 groups 32 input columns: latent_dim "
        f"{e.latent_dim} and expert_dim {e.expert_dim} must be multiples of 32")
  check_backend("model.moe.gmm_backend", e.gmm_backend, GMM_BACKENDS)
  check(e.balance_cutoff in ("k_plus_1", "leave_one_out"), "model.moe.balance_cutoff",
        f"must be 'k_plus_1' or 'leave_one_out', got {e.balance_cutoff!r}")


def _check_vision(m: ml_collections.ConfigDict) -> None:
  v = m.vision
  for field in ("num_layers", "width", "num_heads", "head_dim", "mlp_dim", "patch_size",
                "merge", "temporal_pool", "pos_grid", "max_media"):
    check(v[field] >= 1, f"model.vision.{field}", f"must be >= 1, got {v[field]}")
  unit = v.merge * v.merge * v.temporal_pool
  check(v.max_patches >= unit and v.max_patches % unit == 0, "model.vision.max_patches",
        f"{v.max_patches} must be a positive multiple of merge**2 * temporal_pool = {unit}")
  check(v.projector_hidden >= -1, "model.vision.projector_hidden",
        f"must be -1 (as wide as its input), 0 (one Dense) or > 0, got {v.projector_hidden}")
  check(v.projector_norm in ("pre", "post"), "model.vision.projector_norm",
        f"must be 'pre' or 'post', got {v.projector_norm!r}")
  check(v.projector_act in ("gelu", "gelu_tanh"), "model.vision.projector_act",
        f"must be 'gelu' or 'gelu_tanh', got {v.projector_act!r}")
  check(v.norm_eps > 0, "model.vision.norm_eps", f"must be positive, got {v.norm_eps}")
  check(not v.rope_2d or v.head_dim % 4 == 0, "model.vision.head_dim",
        f"2-D RoPE turns pairs by column and row in turn: {v.head_dim} is not a multiple of 4")
  if v.enabled:
    check(0 <= v.placeholder_id < m.vocab_size, "model.vision.placeholder_id",
          f"{v.placeholder_id} is not a token id of the vocabulary (vocab_size="
          f"{m.vocab_size}); name a reserved id below it")

"""The experiment config: every field with its K3 default, and validation.

`base_config()` returns the complete schema with the values of the full K3 model
(K3_SPEC section 1); experiment files in `experiments/` start from it and change
fields. `validate(config)` names the first impossible setting it finds. Unknown keys
are rejected by ml_collections itself (the ConfigDict is locked).
"""

from __future__ import annotations

import math
import sys

import ml_collections

REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16")
EXPERT_SPLITS = ("batch", "seq")  # what mesh.expert splits outside the MoE (parallel.rules)
MLA_FORMS = ("expanded", "absorbed")  # model.mla.form
EXPERT_QUANTS = ("none", "mxfp4")  # model.moe.expert_quant


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  m = c.model = ml_collections.ConfigDict()
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
  m.remat_scope = "cycle"  # "cycle": one remat region per scanned cycle; "layer": also one
                           # per layer inside it (the backward holds one layer's activations,
                           # not a cycle's, for one more forward of every scanned layer)
  m.scan_layers = True

  k = m.kda = ml_collections.ConfigDict()
  k.num_heads = 96
  k.head_dim = 128       # d_k = d_v
  k.conv_size = 4
  k.gate_rank = 128      # low-rank decay projection d -> rank -> heads*head_dim
  k.gate = "bounded"     # "bounded": lb*sigmoid(exp(A_log)(f+dt_bias)); "softplus": Kimi Linear
  k.gate_lower_bound = -5.0
  # Tokens per chunk of the chunked form; 0: the backend's default on the platform (the
  # GPU kernel 16, else 64: pallas_kernels.kda.default_chunk_size). Rounding aside, the
  # outputs do not depend on it.
  k.chunk_size = 0
  # pallas_kernels.kda backend: chunk (pure JAX), naive, kernel (Pallas), interpret, auto
  # (kernel on TPU and GPU, chunk on CPU)
  k.backend = "auto"
  # pallas_kernels.short_conv backend (the conv with its SiLU and q/k's L2 norm): reference
  # (plain JAX), kernel (Pallas Triton, GPU), interpret, auto (kernel on GPU, else reference)
  k.conv_backend = "auto"

  a = m.mla = ml_collections.ConfigDict()
  a.num_heads = 96
  a.q_lora_rank = 1_536
  a.kv_lora_rank = 512
  a.qk_nope_dim = 128
  a.qk_rope_dim = 64     # NoPE: the "rope" slot is never rotated; one key shared by all heads
  a.v_head_dim = 128
  # pallas_kernels.attention backend: "dense" ([B, H, T, T] fp32 scores), "flash" (the
  # platform's flash kernel; interpret mode on CPU) or "auto" (flash on TPU and GPU, dense
  # on CPU). Dense by default: splash's Mosaic compile makes a micro model's TPU train
  # step compile take over 14 CPU-minutes here; configs for accelerators choose "auto".
  a.attention = "dense"
  # "expanded": keys and values per head from c_kv (k_nope, v = c_kv W_kvb), as written;
  # "absorbed": W_kvb folded into the queries and outputs, so attention reads c_kv and the
  # shared key (kv_lora + rope values a token, one "head") instead of H x (nope + rope + v):
  # (kv_lora + rope + kv_lora) / (nope + rope + v) times the attention FLOPs, for sequences
  # whose per-head keys would not fit (long context: each device attends over every position)
  a.form = "expanded"

  f = m.ffn = ml_collections.ConfigDict()
  f.hidden_dim = 33_792  # dense FFN of the first `dense_layers` layers
  f.activation = "situ_glu"  # or "swiglu" (ablation)
  f.situ_b1 = 4.0
  f.situ_b2 = 25.0

  e = m.moe = ml_collections.ConfigDict()
  e.num_experts = 896
  e.top_k = 16
  e.expert_dim = 3_072
  e.latent_dim = 3_584   # routed experts run in this latent; = d_model for a full-width MoE
  e.num_shared = 2
  e.shared_dim = 3_072
  e.routed_scaling = 1.0
  e.dispatch = "dropless"    # "dropless" (ragged_dot), "capacity" (fixed buffers),
                             # "expert_parallel" (capacity, all-to-all of z over mesh.expert),
                             # "expert_parallel_dropless" (dropless per device, ragged
                             # all-to-all over mesh.expert; TPU / GPU only)
                             # or "auto": expert_parallel_dropless on TPU (ragged_dot lowers
                             # to grouped-matmul kernels) and on GPU where the Mosaic GPU
                             # grouped matmuls take the experts' shapes and mesh.expert is 1,
                             # capacity elsewhere (CPU; XLA's ragged_dot runs far below the
                             # matmul rate on H200: results/moe.md); see
                             # moe_dispatch.resolve_dispatch
  e.capacity_factor = 2.0    # "capacity": rows per expert = factor * tokens * top_k / experts
  # The dropless dispatches route a device's tokens this many at a time, each chunk's
  # expert activations rematerialized (0: all at once); bounds the MoE's memory at long
  # sequences. The capacity dispatches refuse it (their buffers are per row)
  e.token_chunk = 0
  # The dropless dispatches' grouped matmuls (pallas_kernels.grouped_matmul): "auto" (the
  # Mosaic GPU kernels on GPU, warp-specialized where the shapes fit their tiles; ragged_dot
  # elsewhere), "reference" (ragged_dot), "kernel" (per-tile), "kernel_ws"
  e.gmm_backend = "auto"
  # "mxfp4": the routed experts' weights fake-quantized to the released K3's MXFP4 grid in
  # the forward, gradients straight through (quantization-aware training; k3jax.model.mxfp4)
  e.expert_quant = "none"
  e.balancing = "quantile"   # "quantile" (K3) or "none"
  e.balance_bins = 1_000
  # Cutoff r is measured against: "k_plus_1" (spec: the (k+1)-th value for every expert)
  # or "leave_one_out" (the k-th value for unselected experts; removes the atom at b_j
  # that lets loads stall below target, see quantile_balancing.solve_bias).
  e.balance_cutoff = "k_plus_1"

  r = m.attn_res = ml_collections.ConfigDict()
  r.enabled = True       # False: the plain residual stream
  r.block_layers = 12
  # What the scan over cycles saves for the backward: "buffer" (jax.lax.scan: every cycle's
  # whole source buffer [slots, B, T, d]) or "partial" (`attn_res.scan`: the cycle's partial
  # slot [B, T, d]; the backward rebuilds the rest from the final sources)
  r.scan_saves = "buffer"

  v = m.vision = ml_collections.ConfigDict()   # MoonViT-V2 (K3_SPEC 6; k3jax.model.vision)
  v.enabled = False      # True: K3Model builds the tower (fed by data.images)
  v.num_layers = 27
  v.width = 1_024
  v.num_heads = 12
  v.head_dim = 128       # attention inner width heads * head_dim = 1536
  v.mlp_dim = 4_096      # GELU-tanh MLP
  v.patch_size = 14      # pixels per side of a patch: patches of 14 x 14 x 3
  v.merge = 2            # m x m neighbouring patches are concatenated into one token
  # video: this many consecutive frames are mean-pooled into one token (the release: 4, the
  # frames its fixed time table covers, init_pos_emb_time; a chunk's frames are averaged)
  v.temporal_pool = 4
  v.pos_grid = 64        # G: the table's base grid, interpolated bilinearly to each image
  v.max_patches = 16_384  # N: patches in one packed buffer (and most of one image); the data
                         # pipeline packs one buffer per batch row
  v.max_media = 64       # images / videos in one packed buffer (one batch row)
  # The released K3's tower: 2-D RoPE on q and k in every block (head_dim's pairs turn by
  # column and row in turn, theta 10000); its RMSNorms' eps is torch's default for bf16
  v.rope_2d = True
  v.rope_theta = 10_000.0
  v.norm_eps = 2.0 ** -7  # the blocks' and the final norm's (the projector's: model.norm_eps)
  # Projector merge**2 * width -> d_model: -1 (the release): Dense to merge**2 * width, GELU,
  # Dense; > 0: the same this wide; 0: one Dense. projector_norm "post" (the release:
  # RMSNorm of the output) or "pre" (of the input); projector_act "gelu" (erf) or "gelu_tanh"
  v.projector_hidden = -1
  v.projector_norm = "post"
  v.projector_act = "gelu"
  v.placeholder_id = 163_605  # the text token the image features replace (Kimi's media placeholder)
  v.attention = "dense"  # pallas_kernels.attention backend, as model.mla.attention

  t = c.train = ml_collections.ConfigDict()
  t.seq_len = 4_096
  t.global_batch = 1_024
  t.microbatches = 1     # gradient accumulation: the global batch as this many sequential
                         # slices per step; the same update in a slice's activation memory
  t.cast_params_once = False  # True: the parameters that name a compute dtype (LatentMoE's
                         # routed expert matrices) are cast to it once per step, before the
                         # microbatches, not in every microbatch's forward and recompute; the
                         # same gradients, for a copy of them in the compute dtype
  t.loss_chunk = 0       # > 0: the LM head + loss over this many positions at a time (under
                         # remat: no [T, vocab] logits); must divide seq_len. 0: all at once
  # XLA compiler options of the train and eval steps, "name=value" items split by commas or
  # spaces. One named xla_tpu_* / xla_gpu_* / xla_cpu_* applies on that platform only (the
  # same config runs anywhere); any other applies everywhere. Checked against the compiler
  # when the program is built (`xla_options`).
  t.xla_options = ""
  # True: XLA's deterministic ops on GPU (sorted scatters instead of atomic adds,
  # deterministic autotuning), so that a run repeats its losses bit for bit; TPU and CPU
  # steps repeat anyway. k3_small's step fails at run time with it on JAX 0.11.2's GPU
  # build (benchmarks/results/train_step.md).
  t.deterministic = False
  t.steps = 100_000
  t.log_every = 10
  t.eval_every = 1_000
  t.eval_batches = 4
  # Tasks scored at each eval as well (`k3jax.scoring`, what `python -m k3jax.eval` runs),
  # comma-separated; "": none. Text files (globs) for bits per byte, multiple-choice JSONL
  # files for accuracy; sequences of seq_len + 1 tokens, a microbatch's rows at once.
  t.eval_text = ""
  t.eval_choices = ""
  t.checkpoint_every = 1_000
  t.keep_checkpoints = 3       # the newest N checkpoints are kept
  t.keep_checkpoint_every = 0  # and, for good, every step that is a multiple of this (0: none)
  # A weights checkpoint (`python -m k3jax.convert import`) whose parameters a run with no
  # checkpoint of its own starts from (step 0, fresh optimizer state); "" : random init
  t.init_from = ""
  t.checkpoint_compression = False  # zstd: more save/restore CPU time for a little less disk
                                    # (benchmarks/results/checkpoint.md)
  t.max_bad_steps = 10   # this many non-finite (skipped) steps in a row stop the run
  # "S:K": a run resuming from step S first discards the data of its next K steps (the
  # batches of a divergence, which the stop message names); "": none
  t.skip_batches = ""
  # JAX's persistent compilation cache in <workdir>/compilation_cache, so that a restarted
  # run loads its compiled programs instead of compiling them again (train.steps is part of
  # the train step's program); a cache directory JAX already has (JAX_COMPILATION_CACHE_DIR)
  # is used instead. False: none.
  t.compilation_cache = True
  t.grad_clip_norm = 1.0
  t.peak_tflops = 0.0    # per-device peak for the MFU estimate; 0 = detect from the device

  o = c.optimizer = ml_collections.ConfigDict()
  o.name = "muon"        # "muon": Muon for matrices + AdamW for the rest; "adamw": AdamW only
  o.learning_rate = 3e-4  # one schedule for both (Muon's update RMS is matched to AdamW's)
  # Linear warmup to learning_rate. One longer than train.steps (a short run of a config
  # made for a longer one) is cut by validate() to train.steps // 10, with a notice.
  o.warmup_steps = 2_000
  o.min_lr_ratio = 0.1   # cosine decays to learning_rate * min_lr_ratio
  o.b1 = 0.9             # AdamW
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1   # decoupled, matrices only (Muon and AdamW alike)
  o.qk_clip_tau = 100.0  # QK-Clip: cap on each MLA head's max pre-softmax logit; 0 = off

  u = o.muon = ml_collections.ConfigDict()
  u.momentum = 0.95
  u.nesterov = True
  u.ns_steps = 5
  u.ns_coeffs = (3.4445, -4.7750, 2.0315)
  u.ns_eps = 1e-7        # Newton-Schulz input: X / (||X||_F + ns_eps)
  u.ns_dtype = "bfloat16"  # Newton-Schulz operands (accumulation is fp32)
  u.ns_backend = "auto"  # pallas_kernels.newton_schulz backend
  # GPU kernels' [m, m] iteration for bf16: "fp16" operands (faster) or "bf16x3" (much closer
  # to the float32 polynomial on ill-conditioned blocks, slower: results/newton_schulz.md)
  u.ns_gpu_iterate = "fp16"
  u.rms_scale = 0.2      # update = rms_scale * sqrt(max(fan_in, fan_out)) * NS(momentum)
  u.per_head = True      # per-head blocks for KDA q/k/v and MLA W_qb/W_kvb; False: whole matrix
  u.router = "adamw"     # the MoE router's optimizer: "adamw" or "muon"

  p = c.mesh = ml_collections.ConfigDict()   # device mesh axes (k3jax.parallel.mesh)
  p.data = -1            # -1: the devices the other axes leave
  p.fsdp = 1
  p.expert = 1
  p.context = 1          # context parallelism: each sequence's positions split this many ways
  p.tensor = 1
  # The token dimension mesh.expert splits outside the MoE layers: "batch" (rows) or "seq"
  # (positions, with mesh.context: sequences too long for a row per expert device)
  p.expert_splits = "batch"
  # TPU: an axis may take part of a physical torus axis (e.g. 4 x 2 of an 8-chip ring);
  # its collectives then use part of a ring. False: each axis is whole physical axes.
  p.split_physical_axes = False
  # Multi-slice TPU: how many of each axis's ways run across slices over DCN (the rest, the
  # ICI part mesh.<axis> / dcn_<axis>, stay within a slice); they multiply to the number of
  # slices. Usually data parallelism alone crosses DCN: dcn_data = slices.
  p.dcn_data = 1
  p.dcn_fsdp = 1
  p.dcn_expert = 1
  p.dcn_context = 1
  p.dcn_tensor = 1

  from k3jax.data import data_config  # noqa: PLC0415  (the data package owns its defaults)
  c.data = data_config()

  c.lock()
  return c


# Fields a checkpoint depends on: the shapes and structure of the parameters, the optimizer
# state and the Quantile-Balancing biases, and what the saved data-iterator position means.
# A run resumes only under a config that agrees on each (compute dtypes, remat, kernels,
# learning rate etc. may change). k3jax.checkpoint.check_shapes backs this list up.
RESTORE_FIELDS = (
    "seed", "train.seq_len", "data.source", "data.packing", "data.sources",
    "data.heldout_every", "data.tokenizer.kind", "data.tokenizer.bos_token",
    "data.tokenizer.eos_token", "data.images.source", "data.images.weight", "data.images.paths",
    "data.images.train_examples", "data.images.min_size", "data.images.max_size",
    "model.vision.max_patches", "model.vision.max_media", "model.vision.placeholder_id",
    "model.vocab_size", "model.d_model", "model.num_layers", "model.mla_every",
    "model.final_mla", "model.dense_layers", "model.scan_layers",
    "model.kda.num_heads", "model.kda.head_dim", "model.kda.conv_size", "model.kda.gate_rank",
    "model.mla.num_heads", "model.mla.q_lora_rank", "model.mla.kv_lora_rank",
    "model.mla.qk_nope_dim", "model.mla.qk_rope_dim", "model.mla.v_head_dim",
    "model.ffn.hidden_dim", "model.ffn.activation",
    "model.moe.num_experts", "model.moe.expert_dim", "model.moe.latent_dim",
    "model.moe.num_shared", "model.moe.shared_dim", "model.moe.balancing",
    "model.attn_res.enabled", "model.attn_res.block_layers",
    "model.vision.enabled", "model.vision.num_layers", "model.vision.width",
    "model.vision.num_heads", "model.vision.head_dim", "model.vision.mlp_dim",
    "model.vision.patch_size", "model.vision.merge",
    "model.vision.pos_grid", "model.vision.projector_hidden", "model.vision.projector_norm",
    "optimizer.name", "optimizer.muon.per_head", "optimizer.muon.router",
)
# Those that fix the model's parameters: what a checkpoint read for its weights alone
# (train.init_from, generate, eval, export) must agree on.
MODEL_RESTORE_FIELDS = tuple(f for f in RESTORE_FIELDS if f.startswith("model."))


class ConfigError(ValueError):
  """An impossible or unknown configuration setting."""


_PLATFORM_PREFIXES = ("xla_tpu_", "xla_gpu_", "xla_cpu_")


def xla_options(spec: str, platform: str) -> dict[str, str]:
  """{name: value} of the "name=value" items of `spec` (config.train.xla_options) that apply
  on `platform` ("tpu", "gpu", "cpu"; "any": all of them). ConfigError for an item that is
  not an `xla_*=value` pair."""
  options = {}
  for item in spec.replace(",", " ").split():
    name, eq, value = item.lstrip("-").partition("=")
    _check(bool(eq and value) and name.startswith("xla_"), "train.xla_options",
           f"{item!r} is not an XLA option as name=value (e.g. "
           "xla_tpu_enable_latency_hiding_scheduler=false)")
    prefix = next((p for p in _PLATFORM_PREFIXES if name.startswith(p)), None)
    if platform == "any" or prefix is None or prefix == f"xla_{platform}_":
      options[name] = value
  return options


def _check(ok: bool, field: str, msg: str):
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raise ConfigError naming the first impossible setting; return `c` otherwise, with a
  warmup longer than the run shortened (`fit_warmup`)."""
  m = c.model
  _check(m.d_model > 0, "model.d_model", f"must be positive, got {m.d_model}")
  _check(m.num_layers >= 1, "model.num_layers", f"must be >= 1, got {m.num_layers}")
  _check(m.mla_every >= 1, "model.mla_every", f"must be >= 1, got {m.mla_every}")
  _check(0 <= m.dense_layers <= m.num_layers, "model.dense_layers",
         f"must be in [0, num_layers={m.num_layers}], got {m.dense_layers}")
  _check(m.dense_layers <= m.mla_every, "model.dense_layers",
         f"dense layers must lie in the first hybrid cycle (<= mla_every={m.mla_every})")
  _check(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {m.dtype!r}")
  _check(m.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}")
  _check(m.remat in REMAT_POLICIES, "model.remat",
         f"must be one of {REMAT_POLICIES}, got {m.remat!r}")
  _check(m.remat_scope in ("cycle", "layer"), "model.remat_scope",
         f"must be 'cycle' or 'layer', got {m.remat_scope!r}")
  k = m.kda
  _check(k.num_heads * k.head_dim > 0, "model.kda", "num_heads and head_dim must be positive")
  _check(k.gate in ("bounded", "softplus"), "model.kda.gate",
         f"must be 'bounded' or 'softplus', got {k.gate!r}")
  _check(k.gate_lower_bound < 0, "model.kda.gate_lower_bound", "must be negative")
  _check(k.conv_size >= 1, "model.kda.conv_size", "must be >= 1")
  _check(k.chunk_size == 0 or (k.chunk_size >= 16 and not k.chunk_size & (k.chunk_size - 1)),
         "model.kda.chunk_size", f"must be 0 (the backend's default) or a power of two >= 16, "
         f"got {k.chunk_size}")
  from pallas_kernels.kda import BACKENDS as KDA_BACKENDS  # noqa: PLC0415
  _check(k.backend in KDA_BACKENDS, "model.kda.backend",
         f"unknown backend {k.backend!r} (known: {', '.join(KDA_BACKENDS)})")
  from pallas_kernels.short_conv import BACKENDS as CONV_BACKENDS  # noqa: PLC0415
  _check(k.conv_backend in CONV_BACKENDS, "model.kda.conv_backend",
         f"unknown backend {k.conv_backend!r} (known: {', '.join(CONV_BACKENDS)})")
  _check(k.gate == "bounded" or k.backend == "naive", "model.kda.backend",
         "the chunked form needs the bounded gate (g >= gate_lower_bound); use the 'naive' "
         "backend with gate='softplus'")
  _check(k.gate_lower_bound >= -5.0 or k.backend == "naive", "model.kda.gate_lower_bound",
         f"{k.gate_lower_bound} is below -5: 16-token tiles of the chunked form would overflow")
  a = m.mla
  _check(a.q_lora_rank <= m.d_model, "model.mla.q_lora_rank",
         f"{a.q_lora_rank} is wider than d_model={m.d_model}")
  _check(a.kv_lora_rank <= m.d_model, "model.mla.kv_lora_rank",
         f"{a.kv_lora_rank} is wider than d_model={m.d_model}")
  from pallas_kernels.attention import BACKENDS as ATTENTION_BACKENDS  # noqa: PLC0415
  for field in ("mla", "vision"):
    _check(m[field].attention in ATTENTION_BACKENDS, f"model.{field}.attention",
           f"unknown backend {m[field].attention!r} (known: {', '.join(ATTENTION_BACKENDS)})")
  _check(a.form in MLA_FORMS, "model.mla.form", f"must be one of {MLA_FORMS}, got {a.form!r}")
  _check(m.ffn.activation in ("situ_glu", "swiglu"), "model.ffn.activation",
         f"must be 'situ_glu' or 'swiglu', got {m.ffn.activation!r}")
  e = m.moe
  _check(1 <= e.top_k <= e.num_experts, "model.moe.top_k",
         f"must be in [1, num_experts={e.num_experts}], got {e.top_k}")
  _check(e.latent_dim <= m.d_model, "model.moe.latent_dim",
         f"latent {e.latent_dim} is wider than the hidden d_model={m.d_model}")
  _check(e.balancing in ("quantile", "none"), "model.moe.balancing",
         f"must be 'quantile' or 'none', got {e.balancing!r}")
  _check(e.balancing != "quantile" or e.top_k < e.num_experts, "model.moe.top_k",
         "quantile balancing needs top_k < num_experts (it reads the (k+1)-th score)")
  from k3jax.model.moe_dispatch import DISPATCHES  # noqa: PLC0415  (the one list of names)
  _check(e.dispatch in DISPATCHES, "model.moe.dispatch",
         f"must be one of {DISPATCHES}, got {e.dispatch!r}")
  _check(e.capacity_factor > 0, "model.moe.capacity_factor", "must be positive")
  _check(e.token_chunk >= 0, "model.moe.token_chunk", "must be >= 0 (0: all tokens at once)")
  _check(not e.token_chunk or e.dispatch not in ("capacity", "expert_parallel"),
         "model.moe.token_chunk", f"needs a dropless dispatch; model.moe.dispatch is "
         f"{e.dispatch!r} (a per-row capacity buffer cannot be chunked)")
  _check(e.expert_quant in EXPERT_QUANTS, "model.moe.expert_quant",
         f"must be one of {EXPERT_QUANTS}, got {e.expert_quant!r}")
  _check(e.expert_quant == "none" or (e.latent_dim % 32 == 0 and e.expert_dim % 32 == 0),
         "model.moe.expert_quant", f"mxfp4 groups 32 input columns: latent_dim "
         f"{e.latent_dim} and expert_dim {e.expert_dim} must be multiples of 32")
  from pallas_kernels.grouped_matmul import BACKENDS as GMM_BACKENDS  # noqa: PLC0415
  _check(e.gmm_backend in GMM_BACKENDS, "model.moe.gmm_backend",
         f"must be one of {GMM_BACKENDS}, got {e.gmm_backend!r}")
  _check(e.balance_cutoff in ("k_plus_1", "leave_one_out"), "model.moe.balance_cutoff",
         f"must be 'k_plus_1' or 'leave_one_out', got {e.balance_cutoff!r}")
  r = m.attn_res
  _check(r.block_layers >= 1, "model.attn_res.block_layers", "must be >= 1")
  _check(r.scan_saves in ("buffer", "partial"), "model.attn_res.scan_saves",
         f"must be 'buffer' or 'partial', got {r.scan_saves!r}")
  _check_vision(m)
  p = c.mesh
  for heads in ("kda", "mla"):
    n = m[heads].num_heads
    _check(p.tensor == -1 or n % p.tensor == 0, "mesh.tensor",
           f"{p.tensor} does not divide model.{heads}.num_heads={n}")
  _check(not m.vision.enabled or p.tensor == -1 or m.vision.num_heads % p.tensor == 0,
         "mesh.tensor", f"{p.tensor} does not divide model.vision.num_heads={m.vision.num_heads}")
  _check(p.expert == -1 or e.num_experts % p.expert == 0, "mesh.expert",
         f"{p.expert} does not divide model.moe.num_experts={e.num_experts}")
  for axis in ("data", "fsdp", "expert", "context", "tensor"):
    dcn = p[f"dcn_{axis}"]
    _check(dcn >= 1, f"mesh.dcn_{axis}", f"must be >= 1 (slices along mesh.{axis}), got {dcn}")
    _check(p[axis] == -1 or p[axis] % dcn == 0, f"mesh.dcn_{axis}",
           f"{dcn} slices do not divide mesh.{axis}={p[axis]} (its ICI part must be whole)")
  t = c.train
  _check(t.seq_len >= 2, "train.seq_len", f"must be >= 2, got {t.seq_len}")
  _check(t.global_batch >= 1, "train.global_batch", "must be >= 1")
  _check(t.microbatches >= 1 and t.global_batch % t.microbatches == 0, "train.microbatches",
         f"{t.microbatches} must be >= 1 and divide train.global_batch={t.global_batch}")
  _check(t.loss_chunk >= 0 and (t.loss_chunk == 0 or t.seq_len % t.loss_chunk == 0),
         "train.loss_chunk", f"{t.loss_chunk} must be 0 or a positive divisor of "
         f"train.seq_len={t.seq_len}")
  _check(p.expert_splits in EXPERT_SPLITS, "mesh.expert_splits",
         f"must be one of {EXPERT_SPLITS}, got {p.expert_splits!r}")
  seq_ways = [p.context] + ([p.expert] if p.expert_splits == "seq" else [])
  if -1 not in seq_ways:
    check_context(c, math.prod(seq_ways))
  xla_options(t.xla_options, "any")  # its syntax; the names when the program is built
  _check(t.checkpoint_every >= 1, "train.checkpoint_every",
         f"must be >= 1, got {t.checkpoint_every}")
  _check(t.keep_checkpoint_every >= 0 and t.keep_checkpoint_every % t.checkpoint_every == 0,
         "train.keep_checkpoint_every", f"{t.keep_checkpoint_every} must be 0 or a multiple "
         f"of train.checkpoint_every={t.checkpoint_every}")
  _check(t.max_bad_steps >= 1, "train.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}")
  skip_batches(t)
  o = c.optimizer
  from k3jax.optim import OPTIMIZERS  # noqa: PLC0415  (the registry is the one list of names)
  _check(o.name in OPTIMIZERS, "optimizer.name",
         f"unknown optimizer {o.name!r} (known: {', '.join(sorted(OPTIMIZERS))})")
  _check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  fit_warmup(c)
  _check(o.qk_clip_tau >= 0, "optimizer.qk_clip_tau", "must be >= 0 (0 turns QK-Clip off)")
  u = o.muon
  _check(u.router in ("adamw", "muon"), "optimizer.muon.router",
         f"must be 'adamw' or 'muon', got {u.router!r}")
  _check(u.ns_steps >= 1, "optimizer.muon.ns_steps", f"must be >= 1, got {u.ns_steps}")
  _check(len(u.ns_coeffs) == 3, "optimizer.muon.ns_coeffs", "must be 3 numbers (a, b, c)")
  _check(u.ns_dtype in DTYPES, "optimizer.muon.ns_dtype", f"must be one of {DTYPES}")
  _check(0 <= u.momentum < 1, "optimizer.muon.momentum", "must be in [0, 1)")
  from pallas_kernels.newton_schulz import BACKENDS, GPU_ITERATE  # noqa: PLC0415
  _check(u.ns_backend in BACKENDS, "optimizer.muon.ns_backend",
         f"unknown backend {u.ns_backend!r} (known: {', '.join(BACKENDS)})")
  _check(u.ns_gpu_iterate in GPU_ITERATE, "optimizer.muon.ns_gpu_iterate",
         f"must be one of {', '.join(GPU_ITERATE)}, got {u.ns_gpu_iterate!r}")
  from k3jax.data import check_config as check_data  # noqa: PLC0415  (reads no file)
  try:
    check_data(c.data)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _check(c.data.images.source == "none" or m.vision.enabled, "data.images.source",
         f"{c.data.images.source!r} needs model.vision.enabled (the tower that reads them)")
  return c


def skip_batches(t: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """train.skip_batches "S:K" as (S, K); None for "". ConfigError otherwise."""
  if not t.skip_batches:
    return None
  try:
    start, count = (int(x) for x in t.skip_batches.split(":"))
  except ValueError:
    start = count = -1
  _check(start >= 0 and count >= 1, "train.skip_batches",
         f"expected 'S:K' (from step S >= 0, skip K >= 1 batches), got {t.skip_batches!r}")
  return start, count


def fit_warmup(c: ml_collections.ConfigDict) -> None:
  """A warmup longer than the run (optimizer.warmup_steps > train.steps: a short run of a
  config made for a longer one) becomes a tenth of the run, the share k3_tiny's 30 of 300
  steps take, so that the schedule still reaches its peak and decays; one line on stderr
  says so. A warmup within the run is left as it is."""
  o, steps = c.optimizer, c.train.steps
  if o.warmup_steps > steps:
    fitted = steps // 10
    print(f"config: optimizer.warmup_steps={o.warmup_steps} is longer than train.steps="
          f"{steps}: warming up over {fitted} steps (a tenth of the run)", file=sys.stderr,
          flush=True)
    o.warmup_steps = fitted


def check_context(c: ml_collections.ConfigDict, ways: int) -> None:
  """ConfigError unless `ways` context-parallel devices each take a whole number of KDA
  chunks of every sequence: seq_len % (ways * chunk) == 0, chunk = model.kda.chunk_size or
  16 (the shortest any backend runs; `pallas_kernels.kda` halves its default chunk until it
  divides a slice); and of loss chunks (train.loss_chunk)."""
  chunk = c.model.kda.chunk_size or 16
  _check(ways >= 1, "mesh.context", f"must be >= 1 or -1 (fill), got {ways}")
  _check(c.train.seq_len % (ways * chunk) == 0 or ways == 1, "mesh.context",
         f"{ways} devices split train.seq_len={c.train.seq_len} into slices that are not a "
         f"whole number of KDA chunks of {chunk}: seq_len must be a multiple of "
         f"{ways} x {chunk} = {ways * chunk}")
  lc = c.train.loss_chunk
  _check(ways == 1 or not lc or lc >= c.train.seq_len or c.train.seq_len % (ways * lc) == 0,
         "train.loss_chunk", f"{lc} positions a chunk do not split each of the {ways} "
         f"context-parallel slices of train.seq_len={c.train.seq_len}")


def _check_vision(m: ml_collections.ConfigDict) -> None:
  v = m.vision
  for field in ("num_layers", "width", "num_heads", "head_dim", "mlp_dim", "patch_size",
                "merge", "temporal_pool", "pos_grid", "max_media"):
    _check(v[field] >= 1, f"model.vision.{field}", f"must be >= 1, got {v[field]}")
  unit = v.merge * v.merge * v.temporal_pool
  _check(v.max_patches >= unit and v.max_patches % unit == 0, "model.vision.max_patches",
         f"{v.max_patches} must be a positive multiple of merge**2 * temporal_pool = {unit}")
  _check(v.projector_hidden >= -1, "model.vision.projector_hidden",
         f"must be -1 (as wide as its input), 0 (one Dense) or > 0, got {v.projector_hidden}")
  _check(v.projector_norm in ("pre", "post"), "model.vision.projector_norm",
         f"must be 'pre' or 'post', got {v.projector_norm!r}")
  _check(v.projector_act in ("gelu", "gelu_tanh"), "model.vision.projector_act",
         f"must be 'gelu' or 'gelu_tanh', got {v.projector_act!r}")
  _check(v.norm_eps > 0, "model.vision.norm_eps", f"must be positive, got {v.norm_eps}")
  _check(not v.rope_2d or v.head_dim % 4 == 0, "model.vision.head_dim",
         f"2-D RoPE turns pairs by column and row in turn: {v.head_dim} is not a multiple of 4")
  if v.enabled:
    _check(0 <= v.placeholder_id < m.vocab_size, "model.vision.placeholder_id",
           f"{v.placeholder_id} is not a token id of the vocabulary (vocab_size="
           f"{m.vocab_size}); name a reserved id below it")

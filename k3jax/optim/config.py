"""The `optimizer` section: `optimizer_config()` with K3's values, `validate_optimizer`."""

from __future__ import annotations

import ml_collections

from k3jax.config_error import check, check_backend
from k3jax.optim import OPTIMIZERS
from pallas_kernels.newton_schulz import BACKENDS as NS_BACKENDS
from pallas_kernels.newton_schulz import GPU_ITERATE
from pallas_kernels.newton_schulz import RENAMED as NS_RENAMED

NS_DTYPES = ("float32", "bfloat16")  # optimizer.muon.ns_dtype


def optimizer_config() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.name = "muon"        # "muon": Muon for matrices + AdamW for the rest; "adamw": AdamW only
  o.learning_rate = 3e-4  # one schedule for both (Muon's update RMS is matched to AdamW's)
  # Linear warmup to learning_rate; longer than the run: cut to train.steps // 10
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
  u.ns_backend = "auto"  # pallas_kernels.newton_schulz BACKENDS
  # GPU bf16 iteration: "fp16" (faster) or "bf16x3" (closer to fp32; newton_schulz.md)
  u.ns_gpu_iterate = "fp16"
  # Same-shaped blocks of several parameters orthogonalized in one Newton-Schulz, up to this
  # many bytes a device a call: fewer, larger launches and a smaller program; 0: one a parameter
  u.group_bytes = 256 * 2**20
  u.rms_scale = 0.2      # update = rms_scale * sqrt(max(fan_in, fan_out)) * NS(momentum)
  u.per_head = True      # per-head blocks for KDA q/k/v and MLA W_qb/W_kvb; False: whole matrix
  u.router = "adamw"     # the MoE router's optimizer: "adamw" or "muon"
  return o


def validate_optimizer(o: ml_collections.ConfigDict) -> None:
  """ConfigError naming the first impossible setting of the `optimizer` section."""
  check(o.name in OPTIMIZERS, "optimizer.name",
        f"unknown optimizer {o.name!r} (known: {', '.join(sorted(OPTIMIZERS))})")
  check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  check(o.qk_clip_tau >= 0, "optimizer.qk_clip_tau", "must be >= 0 (0 turns QK-Clip off)")
  u = o.muon
  check(u.router in ("adamw", "muon"), "optimizer.muon.router",
        f"must be 'adamw' or 'muon', got {u.router!r}")
  check(u.ns_steps >= 1, "optimizer.muon.ns_steps", f"must be >= 1, got {u.ns_steps}")
  check(len(u.ns_coeffs) == 3, "optimizer.muon.ns_coeffs", "must be 3 numbers (a, b, c)")
  check(u.ns_dtype in NS_DTYPES, "optimizer.muon.ns_dtype", f"must be one of {NS_DTYPES}")
  check(u.group_bytes >= 0, "optimizer.muon.group_bytes", f"must be >= 0, got {u.group_bytes}")
  check(0 <= u.momentum < 1, "optimizer.muon.momentum", "must be in [0, 1)")
  check_backend("optimizer.muon.ns_backend", u.ns_backend, NS_BACKENDS, NS_RENAMED)
  check(u.ns_gpu_iterate in GPU_ITERATE, "optimizer.muon.ns_gpu_iterate",
        f"must be one of {', '.join(GPU_ITERATE)}, got {u.ns_gpu_iterate!r}")

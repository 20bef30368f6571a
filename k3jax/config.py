"""The experiment config: every field with its K3 default, and validation.

`base_config()` is the full K3 model (K3_SPEC 1); experiments/ start from it. Each
package owns its section; `seed`, `train` and the cross-section checks of
`validate(config)` are here. The ConfigDict is locked: unknown keys are rejected."""

from __future__ import annotations

import math
import sys

import ml_collections

from k3jax.config_error import ConfigError, check, check_backend
from k3jax.data.config import data_config, validate_data
from k3jax.model.config import model_config, validate_model
from k3jax.optim.config import optimizer_config, validate_optimizer
from k3jax.parallel.config import mesh_config, validate_mesh
from pallas_kernels.cross_entropy import BACKENDS as LOSS_BACKENDS

__all__ = ["MODEL_RESTORE_FIELDS", "RESTORE_FIELDS", "ConfigError", "base_config",
           "check_context", "fit_warmup", "skip_batches", "train_config", "validate",
           "xla_options"]


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = model_config()
  c.train = train_config()
  c.optimizer = optimizer_config()
  c.mesh = mesh_config()
  c.data = data_config()
  c.lock()
  return c


def train_config() -> ml_collections.ConfigDict:
  """The `train` section: the run's length, batch, evaluation, checkpoints and compiler."""
  t = ml_collections.ConfigDict()
  t.seq_len = 4_096
  t.global_batch = 1_024
  t.microbatches = 1     # gradient accumulation: sequential slices of the global batch
  t.cast_params_once = False  # True: cast the matrices to the compute dtype (and MXFP4-
                              # quantize routed experts) once per step, not in every
                              # microbatch's forward and recompute; same gradients
  t.loss_chunk = 0       # > 0: LM head + loss over this many positions at a time, each
                         # chunk's gradients taken with its logits (divides seq_len); 0: all
                         # at once
  # pallas_kernels.cross_entropy backend of the loss over the LM head's logits: reference,
  # kernel (GPU), interpret, auto (kernel on GPU)
  t.loss_backend = "auto"
  # XLA options "name=value", comma/space separated; xla_tpu_*/xla_gpu_*/xla_cpu_* apply
  # on that platform only
  t.xla_options = ""
  # True: XLA's deterministic GPU ops and kernels (MLA on Triton, not cuDNN): bit-exact repeats
  t.deterministic = False
  # Share of each GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION, set
  # before JAX starts); 0: the environment's, else JAX's default 0.75
  t.gpu_memory_fraction = 0.0
  t.steps = 100_000
  t.log_every = 10
  t.eval_every = 1_000
  t.eval_batches = 4
  # Tasks scored at each eval (k3jax.scoring), comma-separated globs; "": none. Text files
  # for bits per byte, multiple-choice JSONL for accuracy.
  t.eval_text = ""
  t.eval_choices = ""
  t.checkpoint_every = 1_000
  t.keep_checkpoints = 3       # the newest N checkpoints are kept
  t.keep_checkpoint_every = 0  # and, for good, every step that is a multiple of this (0: none)
  # A weights checkpoint (`python -m k3jax.convert import`) a fresh run starts from; "": none
  t.init_from = ""
  t.checkpoint_compression = False  # zstd per array (benchmarks/results/checkpoint.md)
  t.max_bad_steps = 10   # this many non-finite (skipped) steps in a row stop the run
  # "S:K": resuming from step S, skip the data of the next K steps; "": none
  t.skip_batches = ""
  # JAX's persistent compilation cache in <workdir>/compilation_cache (or
  # JAX_COMPILATION_CACHE_DIR), and on GPU and TPU the compiled train step stored
  # there (k3jax.executables); False: neither
  t.compilation_cache = True
  t.grad_clip_norm = 1.0
  t.peak_tflops = 0.0    # per-device peak for the MFU estimate; 0 = detect from the device
  return t


# Fields a checkpoint's state and data position depend on; a resume must agree on each.
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
# Fields that fix the parameters, for checkpoints read for weights alone.
MODEL_RESTORE_FIELDS = tuple(f for f in RESTORE_FIELDS if f.startswith("model."))


_PLATFORM_PREFIXES = ("xla_tpu_", "xla_gpu_", "xla_cpu_")


def xla_options(spec: str, platform: str) -> dict[str, str]:
  """{name: value} of `spec`'s items for `platform` ("any": all); ConfigError if bad."""
  options = {}
  for item in spec.replace(",", " ").split():
    name, eq, value = item.lstrip("-").partition("=")
    check(bool(eq and value) and name.startswith("xla_"), "train.xla_options",
          f"{item!r} is not an XLA option as name=value (e.g. "
          "xla_tpu_enable_latency_hiding_scheduler=false)")
    prefix = next((p for p in _PLATFORM_PREFIXES if name.startswith(p)), None)
    if platform == "any" or prefix is None or prefix == f"xla_{platform}_":
      options[name] = value
  return options


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """ConfigError naming the first impossible setting; else `c` (warmup fitted)."""
  validate_model(c.model)
  _check_mesh_fits_model(c)
  validate_mesh(c.mesh)
  _validate_train(c)
  validate_optimizer(c.optimizer)
  fit_warmup(c)
  validate_data(c.data)
  check(c.data.images.source == "none" or c.model.vision.enabled, "data.images.source",
        f"{c.data.images.source!r} needs model.vision.enabled (the tower that reads them)")
  return c


def _check_mesh_fits_model(c: ml_collections.ConfigDict) -> None:
  """mesh.tensor divides every attention's heads, mesh.expert the routed experts."""
  m, p = c.model, c.mesh
  for heads in ("kda", "mla"):
    n = m[heads].num_heads
    check(p.tensor == -1 or n % p.tensor == 0, "mesh.tensor",
          f"{p.tensor} does not divide model.{heads}.num_heads={n}")
  check(not m.vision.enabled or p.tensor == -1 or m.vision.num_heads % p.tensor == 0,
        "mesh.tensor", f"{p.tensor} does not divide model.vision.num_heads={m.vision.num_heads}")
  check(p.expert == -1 or m.moe.num_experts % p.expert == 0, "mesh.expert",
        f"{p.expert} does not divide model.moe.num_experts={m.moe.num_experts}")


def _validate_train(c: ml_collections.ConfigDict) -> None:
  t, p = c.train, c.mesh
  check(t.seq_len >= 2, "train.seq_len", f"must be >= 2, got {t.seq_len}")
  check(t.global_batch >= 1, "train.global_batch", "must be >= 1")
  check(t.microbatches >= 1 and t.global_batch % t.microbatches == 0, "train.microbatches",
        f"{t.microbatches} must be >= 1 and divide train.global_batch={t.global_batch}")
  check(t.loss_chunk >= 0 and (t.loss_chunk == 0 or t.seq_len % t.loss_chunk == 0),
        "train.loss_chunk", f"{t.loss_chunk} must be 0 or a positive divisor of "
        f"train.seq_len={t.seq_len}")
  check_backend("train.loss_backend", t.loss_backend, LOSS_BACKENDS)
  seq_ways = [p.context] + ([p.expert] if p.expert_splits == "seq" else [])
  if -1 not in seq_ways:
    check_context(c, math.prod(seq_ways))
  xla_options(t.xla_options, "any")
  check(0 <= t.gpu_memory_fraction <= 1, "train.gpu_memory_fraction",
        f"{t.gpu_memory_fraction} must be in (0, 1], or 0 for JAX's default")
  check(t.checkpoint_every >= 1, "train.checkpoint_every",
        f"must be >= 1, got {t.checkpoint_every}")
  check(t.keep_checkpoint_every >= 0 and t.keep_checkpoint_every % t.checkpoint_every == 0,
        "train.keep_checkpoint_every", f"{t.keep_checkpoint_every} must be 0 or a multiple "
        f"of train.checkpoint_every={t.checkpoint_every}")
  check(t.max_bad_steps >= 1, "train.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}")
  skip_batches(t)


def skip_batches(t: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """train.skip_batches "S:K" as (S, K); None for "". ConfigError otherwise."""
  if not t.skip_batches:
    return None
  try:
    start, count = (int(x) for x in t.skip_batches.split(":"))
  except ValueError:
    start = count = -1
  check(start >= 0 and count >= 1, "train.skip_batches",
        f"expected 'S:K' (from step S >= 0, skip K >= 1 batches), got {t.skip_batches!r}")
  return start, count


def fit_warmup(c: ml_collections.ConfigDict) -> None:
  """A warmup longer than the run becomes a tenth of it, with a line on stderr."""
  o, steps = c.optimizer, c.train.steps
  if o.warmup_steps > steps:
    fitted = steps // 10
    print(f"config: optimizer.warmup_steps={o.warmup_steps} is longer than train.steps="
          f"{steps}: warming up over {fitted} steps (a tenth of the run)", file=sys.stderr,
          flush=True)
    o.warmup_steps = fitted


def check_context(c: ml_collections.ConfigDict, ways: int) -> None:
  """ConfigError unless each context device takes whole KDA and loss chunks."""
  chunk = c.model.kda.chunk_size or 16
  check(ways >= 1, "mesh.context", f"must be >= 1 or -1 (fill), got {ways}")
  check(c.train.seq_len % (ways * chunk) == 0 or ways == 1, "mesh.context",
        f"{ways} devices split train.seq_len={c.train.seq_len} into slices that are not a "
        f"whole number of KDA chunks of {chunk}: seq_len must be a multiple of "
        f"{ways} x {chunk} = {ways * chunk}")
  lc = c.train.loss_chunk
  check(ways == 1 or not lc or lc >= c.train.seq_len or c.train.seq_len % (ways * lc) == 0,
        "train.loss_chunk", f"{lc} positions a chunk do not split each of the {ways} "
        f"context-parallel slices of train.seq_len={c.train.seq_len}")

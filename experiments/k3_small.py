"""K3 sized for one H200: 13 layers, d 2048, 64 experts top-8; 2.93B total, 1.0B active.

  python -m k3jax.train --config=experiments/k3_small.py --workdir=/tmp/k3_small

3 hybrid cycles [KDA, KDA, KDA, MLA] + the final MLA; KDA/MLA 16 heads of 128 (the
shapes of the KDA kernel benchmarks); LatentMoE over a 1024-wide latent; AttnRes blocks
of 4 layers. The vocabulary is K3's, so a real tokenizer can replace the byte default.

"multimodal" (`--config=experiments/k3_small.py:multimodal`): the 12-layer MoonViT-V2 below
on, reading generated pictures of 224-448 px (16-32 patches a side) mixed 1:1 with text;
each batch row packs up to 8 of them in 4,096 patches.

MLA attention is "auto": on a GPU, cuDNN's flash attention (Triton `mha` for rows of many
documents; `pallas_kernels.attention.flash_cuda`), no [T, T] scores.

"32k", "128k": long sequences (2 x 32,768 tokens a step as two microbatches; 1 x 131,072):
each scanned layer its own remat region, the LM head and loss 4,096 positions at a time;
at 128k the experts take 16,384 tokens at a time (`moe.token_chunk`), and the step takes
95% of an H200 (`train.gpu_memory_fraction`; JAX's default share is 75%).
"1m": 1 x 1,048,576 over the 8 GPUs of a host (`mesh.context` 8: each holds 128k's share
of positions; MLA exchanges heads for positions). `--config.mesh.context=N` splits any
variant's sequences over N GPUs. Tokens/s and fit: benchmarks/results/context_parallel.md.
"""

from k3jax import config as k3config


_LONG = {"model.remat_scope": "layer",
         "model.attn_res.scan_saves": "partial", "train.loss_chunk": 4_096}
_LONG_VARIANTS = {
    "32k": {**_LONG, "train.seq_len": 32_768, "train.global_batch": 2, "train.microbatches": 2},
    "128k": {**_LONG, "train.seq_len": 131_072, "train.global_batch": 1,
             "train.microbatches": 1, "model.moe.token_chunk": 16_384,
             "train.gpu_memory_fraction": 0.95},
}
# 1M: one sequence a step over the 8 GPUs of a host, 131,072 positions each (128k's share)
_LONG_VARIANTS["1m"] = {**_LONG_VARIANTS["128k"], "train.seq_len": 1_048_576,
                        "mesh.context": 8}
VARIANTS = (None, "", "multimodal", *_LONG_VARIANTS)
# The text step: layers unrolled; remat keeps the kernels' outputs and the named values
# (`model.remat_save`): a faster step for more memory (benchmarks/results/train_step.md).
# The other variants' memory was fitted with scanned cycles under full remat.
_TEXT_STEP = {"model.scan_layers": False, "model.remat": "kernels",
              "model.remat_save": "kda_proj,kda_inputs,glu_proj,glu_out,moe_latent,mla_proj,"
                                  "moe_experts,layer_out"}


def get_config(arg: str | None = None):
  if arg not in VARIANTS:
    raise ValueError(f"experiments/k3_small.py: unknown variant {arg!r} "
                     f"(known: {', '.join(v for v in VARIANTS if v)})")
  c = k3config.base_config()
  m = c.model
  m.d_model = 2_048
  m.num_layers = 13
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank = 16, 128, 128
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 16, 512, 256
  m.mla.attention = "auto"
  m.ffn.hidden_dim = 5_632
  m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.latent_dim = 64, 8, 768, 1_024
  m.moe.shared_dim = 768
  # On the H200 the dropless dispatch on the Mosaic GPU grouped matmuls: a faster train step
  # than capacity at factor 2.0 (benchmarks/results/train_step.md)
  m.moe.dispatch = "auto"
  m.attn_res.block_layers = 4
  # KDA: the base config's "auto" (the Triton kernel at chunk 16 on the H200): a much faster
  # train step than the pure-JAX chunk form at 32 (benchmarks/results/kda.md)
  # A 12-layer, 768-wide MoonViT-V2 (86M + a 16M projector), on in the "multimodal" variant
  # (a tower nothing reads would only take weight decay).
  v = m.vision
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim = 12, 768, 6, 128, 3_072
  v.pos_grid, v.max_patches = 32, 4_096

  t = c.train
  # 16 x 4096 tokens a step as 4 microbatches of 4 rows: a faster step than 8 of 2 (fewer
  # passes over the fp32 gradient sums and the layer stacks) that fits JAX's default share
  # of one H200 (benchmarks/results/train_step.md)
  t.seq_len, t.global_batch, t.microbatches = 4_096, 16, 4
  # The expert matrices cast to bf16 once a step, not in each microbatch's forward and
  # recompute: a faster step for a little more peak memory (benchmarks/results/train_step.md)
  t.cast_params_once = True
  # Every GPU matmul on cuBLAS: a faster compile (no Triton GEMM tilings to autotune) for the
  # same step time (benchmarks/results/compile_time.md)
  t.xla_options = "xla_gpu_enable_triton_gemm=false"
  t.steps = 10_000
  t.log_every, t.eval_every, t.checkpoint_every = 10, 500, 500
  c.optimizer.warmup_steps = 500
  # Pieces read in 8 processes (of the H200 host's 16 cores) ahead of packing; the
  # batches are those of worker_count=0.
  c.data.worker_count = 8
  if arg in (None, ""):
    c.update_from_flattened_dict(_TEXT_STEP)
  if arg == "multimodal":
    v.enabled, v.max_media = True, 8
    c.data.images.source, c.data.images.weight = "generated", 1.0
    c.data.images.min_size, c.data.images.max_size = 224, 448
  if arg in _LONG_VARIANTS:
    c.update_from_flattened_dict(_LONG_VARIANTS[arg])
  return c

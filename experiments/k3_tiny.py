"""K3 at toy size: the full structure, small enough to train on 2 CPU cores.

  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny
  python -m k3jax.train --config=experiments/k3_tiny.py:multimodal --workdir=/tmp/k3_tiny_mm

9 layers = 2 hybrid cycles [KDA, KDA, KDA, MLA] + the final MLA; d 128; 16 experts top-4
over a 64-wide latent; AttnRes blocks of 4 layers. Trains on the embedded corpus.

"multimodal": the same model with a toy MoonViT-V2 (2 layers, width 64) reading generated
pictures (k3jax/data/images.py: shapes, colours, counts, cells; 56-112 px, no download),
mixed 3:1 with the text corpus; each batch row packs up to 4 images in 192 patches.
`benchmarks/multimodal_tiny.py` compares its caption loss on held-out pictures with the
loss given blank ones.
"""

from k3jax import config as k3config


VARIANTS = (None, "", "multimodal")


def get_config(arg: str | None = None):
  if arg not in VARIANTS:
    raise ValueError(f"experiments/k3_tiny.py: unknown variant {arg!r} (known: multimodal)")
  c = k3config.base_config()
  m = c.model
  m.vocab_size = 384  # bytes + specials, padded to a multiple of 128
  m.d_model = 128
  m.num_layers = 9
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank = 4, 32, 16
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 4, 64, 32
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = 32, 16, 32
  m.ffn.hidden_dim = 384
  m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.latent_dim = 16, 4, 128, 64
  m.moe.shared_dim = 128
  m.moe.dispatch = "capacity"  # ragged_dot runs every expert densely on CPU
  m.attn_res.block_layers = 4
  m.dtype = "float32"  # CPU: bf16 matmuls are emulated and slower
  m.remat = "none"
  # A toy MoonViT-V2 (2 layers, width 64), on in the "multimodal" variant. The byte
  # vocabulary has no media placeholder: 258 is the first id after bos / eos.
  v = m.vision
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim = 2, 64, 2, 32, 256
  v.pos_grid, v.max_patches, v.max_media, v.placeholder_id = 16, 1_024, 16, 258

  t = c.train
  t.seq_len, t.global_batch = 128, 8
  t.steps = 300
  t.log_every, t.eval_every, t.checkpoint_every = 10, 100, 100
  # Muon (the default) at 1e-2 beat AdamW at 3e-3 here: benchmarks/results/k3_tiny_optimizers.md
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-2, 30
  c.optimizer.muon.ns_dtype = "float32"  # CPU: bf16 matmuls are emulated
  if arg == "multimodal":
    v.enabled = True
    v.pos_grid = 8                            # 112 px pictures are 8 x 8 patches of 14 px
    v.max_patches, v.max_media = 192, 4       # per batch row: 3 of the largest pictures
    c.data.images.source, c.data.images.weight = "generated", 3.0
  return c

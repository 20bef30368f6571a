"""Analytic FLOPs: a hand count on a tiny model, and 6 N_active on the full K3."""

import jax
import pytest

from k3jax.config import base_config
from k3jax.flops import (
    attn_res_sources,
    flops_per_token,
    format_breakdown,
    layer_kinds,
    mfu,
    peak_flops,
)

K3_ACTIVE_PARAMS = 104.19e9   # K3_SPEC 1: active, incl. the LM head, excl. the embedding


def _tiny():
  """2 layers: 1 = KDA + dense FFN, 2 = MLA + MoE; AttnRes blocks of 1 layer."""
  m = base_config().model
  m.vocab_size, m.d_model, m.num_layers, m.mla_every, m.dense_layers = 10, 8, 2, 2, 1
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank = 2, 4, 2
  m.kda.conv_size, m.kda.chunk_size = 4, 4
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 2, 4, 4
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = 2, 2, 2
  m.ffn.hidden_dim = 16
  m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.latent_dim = 4, 2, 4, 4
  m.moe.num_shared, m.moe.shared_dim = 1, 8
  m.attn_res.block_layers = 1
  return m


def test_tiny_hand_count():
  f = flops_per_token(_tiny(), seq_len=7)
  want = {
      "embedding": 0,
      "lm_head": 2 * 8 * 10,                                     # 160
      # q,k,v,g,o 5*2*8*8 + beta 2*8*2 + decay 2*(8*2 + 2*8) + conv 3*2*4*8
      "kda_proj": 640 + 32 + 64 + 192,                           # 928
      # 2 heads * (6*4*4 + 4*(3*4 + 2*4) + 4*4/3)
      "kda_core": 2 * (96 + 80 + 16 / 3),                        # 362.67
      # qa 2*8*4, qb 2*4*2*4, kva 2*8*6, kvb 2*4*2*4, gate 2*8*4, o 2*4*8
      "mla_proj": 64 + 64 + 96 + 64 + 64 + 64,                   # 416
      # 4 keys per token on average (T=7), per key 2*2*(2+2) scores + 2*2*2 values
      "mla_core": 4 * (16 + 8),                                  # 96
      "dense_ffn": 3 * 2 * 8 * 16,                               # 768
      "moe_router": 2 * 8 * 4,                                   # 64
      "moe_latent": 2 * 2 * 8 * 4,                               # 128
      "moe_routed": 2 * 3 * 2 * 4 * 4,                           # 192
      "moe_shared": 1 * 3 * 2 * 8 * 8,                           # 384
      # sources per sublayer 1, 2 | 2, 3 | output 3 -> 11; 4 d per source
      "attn_res": 4 * 8 * 11,                                    # 352
  }
  for name, value in want.items():
    assert f[name] == pytest.approx(value), name
  assert f["forward"] == pytest.approx(3850 + 2 / 3)
  assert f["train"] == pytest.approx(3 * f["forward"])
  assert f["dense_proj"] == pytest.approx(f["forward"] - 362 - 2 / 3 - 96 - 352)


def test_layer_pattern_and_sources():
  m = base_config().model
  kinds = layer_kinds(m)
  mla = [i + 1 for i, (mixer, _) in enumerate(kinds) if mixer == "mla"]
  assert mla == list(range(4, 93, 4)) + [93] and len(mla) == 24
  assert [ffn for _, ffn in kinds].count("dense") == 1 and kinds[0][1] == "dense"
  src = attn_res_sources(93, 12)
  assert len(src) == 2 * 93 + 1
  assert src[0] == 1 and src[1] == 2 and src[24] == 2 and src[25] == 3
  assert src[-2] == 1 + 7 + 1 and src[-1] == 1 + 8   # 8 blocks, the last of 9 layers
  m.final_mla = False
  assert sum(mixer == "mla" for mixer, _ in layer_kinds(m)) == 23


def test_k3_full_matches_six_n_active():
  f = flops_per_token(base_config().model, seq_len=4096)
  print("\n" + format_breakdown(f))
  ratio = 3 * f["dense_proj"] / (6 * K3_ACTIVE_PARAMS)
  print(f"3 * dense_proj / (6 N_active) = {ratio:.4f}")
  assert ratio == pytest.approx(1.0, rel=0.02)
  # The attention cores are small at 4k context.
  assert f["kda_core"] + f["mla_core"] < 0.05 * f["forward"]


def test_mfu_and_peak_table():
  assert peak_flops(jax.devices("cpu")[0]) is None
  assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert peak_flops("NVIDIA H200") == 989e12
  assert peak_flops("TPU v4") == 275e12
  assert peak_flops("TPU v5 lite") == 197e12
  assert peak_flops("TPU v5") == 459e12
  assert peak_flops("TPU v5p") == 459e12
  assert peak_flops("TPU v6 lite") == 918e12
  assert peak_flops("TPU7x") == 2307e12 / 2  # per device: an Ironwood chip is two
  assert peak_flops("some new chip") is None
  assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
  with pytest.raises(ValueError):
    mfu(1000.0, 6e9, 0.0)

"""k3jax.convert.hf_config: the released Kimi K3's config.json read into k3jax's model
config and written back. The text_config below holds the release's values (as the
engines that load it read them); k3_full is that model."""

import copy

import pytest
from test_config import load

from k3jax.config import ConfigError
from k3jax.convert import hf_config

FULL = [*range(4, 93, 4), 93]
RELEASE = {"model_type": "kimi_k3", "text_config": {
    "model_type": "kimi_linear", "vocab_size": 163_840, "hidden_size": 7_168,
    "intermediate_size": 33_792, "num_hidden_layers": 93, "num_attention_heads": 96,
    "num_key_value_heads": 96, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "attn_res_block_size": 12,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896,
    "num_experts_per_token": 16, "moe_intermediate_size": 3_072, "num_shared_experts": 2,
    "routed_expert_hidden_size": 3_584, "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "q_lora_rank": 1_536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    "max_position_embeddings": 1_048_576,
    "linear_attn_config": {"full_attn_layers": FULL,
                           "kda_layers": [i for i in range(1, 94) if i not in FULL],
                           "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                           "gate_lower_bound": -5.0, "use_full_rank_gate": True}},
    "vision_config": {
        "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear", "vt_num_attention_heads": 12,
        "vt_num_hidden_layers": 27, "vt_hidden_size": 1_024, "vt_intermediate_size": 4_096,
        "qkv_hidden_size": 1_536, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2", "mm_hidden_size": None,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "norm_type": "rmsnorm",
        "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
        "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": 7_168,
        "_attn_implementation": "flash_attention_2"}}


def test_the_release_is_k3_full():
  """Every field the release's config sets equals k3_full's: applying it changes nothing."""
  want = load("k3_full")
  got = hf_config.apply(load("k3_full"), RELEASE)
  assert got.model.to_dict() == want.model.to_dict()
  assert hf_config.vision_fields(RELEASE)["vision.head_dim"] == 128
  fields = hf_config.model_fields(RELEASE)
  assert fields["mla_every"] == 4 and fields["final_mla"] and fields["kda.gate_rank"] == 128


def test_written_back_it_is_the_release():
  """k3_full's model as a text_config: the release's value for every field read above."""
  t = hf_config.text_config(load("k3_full").model)
  for name, value in RELEASE["text_config"].items():
    if name not in ("max_position_embeddings",):       # not a model field here
      assert t[name] == value, name
  assert t["quantization_config"]["format"] == "mxfp4-pack-quantized"
  assert hf_config.model_fields(t) == hf_config.model_fields(RELEASE)


def test_a_small_pattern_round_trips():
  """9 layers, MLA at 4, 8 and the last: read back from its own text_config."""
  c = load("k3_full")
  c.model.num_layers = 9
  t = hf_config.text_config(c.model, quantized=False)
  assert t["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]
  assert "quantization_config" not in t
  assert hf_config.model_fields(t)["num_layers"] == 9


def edited(path, value):
  config = copy.deepcopy(RELEASE)
  node = config["text_config"]
  *parents, last = path.split(".")
  for p in parents:
    node = node[p]
  if value is KeyError:
    del node[last]
  else:
    node[last] = value
  return config


@pytest.mark.parametrize("path, value, match", [
    ("linear_attn_config.full_attn_layers", [4, 8, 13, *range(16, 93, 4), 93],
     "full_attn_layers: .* once each"),
    ("num_expert_group", 8, "num_expert_group: 8: k3jax's model computes 1 only"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("num_key_value_heads", 8, "num_key_value_heads: 8 != num_attention_heads 96"),
    ("hidden_size", KeyError, "hidden_size: missing"),
    ("linear_attn_config.gate_lower_bound", None, "gate_lower_bound: None"),
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers"),
])
def test_what_k3jax_cannot_express_is_named(path, value, match):
  with pytest.raises(ConfigError, match=match):
    hf_config.model_fields(edited(path, value))


def test_an_irregular_mla_pattern_is_refused():
  config = edited("linear_attn_config.full_attn_layers", [3, 8, *range(12, 93, 4), 93])
  config["text_config"]["linear_attn_config"]["kda_layers"] = [
      i for i in range(1, 94)
      if i not in config["text_config"]["linear_attn_config"]["full_attn_layers"]]
  with pytest.raises(ConfigError, match="are not the multiples of 3"):
    hf_config.model_fields(config)


def test_the_vision_config_written_back_is_the_releases():
  """k3_full's tower as a vision_config: the release's value for every field (but the
  attention implementation, a serving choice)."""
  v = hf_config.vision_config(load("k3_full").model)
  want = {k: x for k, x in RELEASE["vision_config"].items() if k != "_attn_implementation"}
  assert v == want


@pytest.mark.parametrize("name, value, match", [
    ("merge_kernel_size", [2, 3], "merge_kernel_size: \\[2, 3\\]: k3jax merges square"),
    ("projector_hidden_act", "relu", "projector_hidden_act: 'relu'"),
    ("vt_hidden_size", KeyError, "vision_config.vt_hidden_size: missing"),
    ("qkv_hidden_size", 1_000, "1000 does not split into 12 heads"),
    ("projector_ln_eps", 1e-6, "projector_ln_eps"),
])
def test_what_the_tower_cannot_express_is_named(name, value, match):
  config = copy.deepcopy(RELEASE)
  if value is KeyError:
    del config["vision_config"][name]
  else:
    config["vision_config"][name] = value
  with pytest.raises(ConfigError, match=match):
    hf_config.vision_fields(config)


def test_a_tower_of_another_form_is_not_written_as_the_releases():
  m = load("k3_full").model
  m.vision.projector_norm = "pre"
  with pytest.raises(ConfigError, match="model.vision.projector_norm='pre'"):
    hf_config.vision_config(m)

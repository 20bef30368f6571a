"""The released Kimi K3's `config.json` and k3jax's model config, both ways.

`model_fields` / `text_config` and `vision_fields` / `vision_config` convert both ways
(round-trip); what k3jax cannot express is a ConfigError naming the release's field."""

from __future__ import annotations

from typing import Any

import ml_collections

from k3jax.config_error import ConfigError

# release field -> k3jax model field, where the two agree one to one
DIRECT = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "num_layers",
    "intermediate_size": "ffn.hidden_dim", "rms_norm_eps": "norm_eps",
    "activation_situ_beta": "ffn.situ_b1", "activation_situ_linear_beta": "ffn.situ_b2",
    "attn_res_block_size": "attn_res.block_layers", "first_k_dense_replace": "dense_layers",
    "num_experts": "moe.num_experts", "num_experts_per_token": "moe.top_k",
    "moe_intermediate_size": "moe.expert_dim", "num_shared_experts": "moe.num_shared",
    "routed_expert_hidden_size": "moe.latent_dim", "routed_scaling_factor": "moe.routed_scaling",
    "num_attention_heads": "mla.num_heads", "q_lora_rank": "mla.q_lora_rank",
    "kv_lora_rank": "mla.kv_lora_rank", "qk_nope_head_dim": "mla.qk_nope_dim",
    "qk_rope_head_dim": "mla.qk_rope_dim", "v_head_dim": "mla.v_head_dim",
}
LINEAR = {"num_heads": "kda.num_heads", "head_dim": "kda.head_dim",
          "short_conv_kernel_size": "kda.conv_size", "gate_lower_bound": "kda.gate_lower_bound"}
# release fields whose value k3jax's model always has (its equations assume them)
FIXED = {"hidden_act": "situ", "moe_layer_freq": 1, "latent_moe_use_norm": True,
         "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
         "mla_use_nope": True, "mla_use_output_gate": True, "num_nextn_predict_layers": 0,
         "tie_word_embeddings": False, "num_expert_group": 1, "topk_group": 1,
         "topk_method": "noaux_tc", "use_grouped_topk": True}
QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed", "global_compression_ratio": None,
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
        "output_activations": None,
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                    "strategy": "group", "dynamic": False, "observer": "minmax",
                    "observer_kwargs": {}, "scale_dtype": "torch.uint8", "zp_dtype": None,
                    "actorder": None, "block_structure": None}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


VISION = {"patch_size": "vision.patch_size", "init_pos_emb_height": "vision.pos_grid",
          "vt_num_attention_heads": "vision.num_heads", "vt_num_hidden_layers":
          "vision.num_layers", "vt_hidden_size": "vision.width",
          "vt_intermediate_size": "vision.mlp_dim", "init_pos_emb_time": "vision.temporal_pool"}
# vision_config fields whose value k3jax's tower always has
VISION_FIXED = {"pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
                "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
                "projector_hidden_act": "gelu", "norm_type": "rmsnorm", "attn_bias": False,
                "linear_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
                "activation_func": "gelu_pytorch_tanh"}


def _fail(field: str, msg: str, section: str = "text_config"):
  raise ConfigError(f"config.json {section}.{field}: {msg}")


def _read(section: dict, direct: dict, fixed: dict, label: str, what: str) -> dict[str, Any]:
  """The `direct` fields as k3jax fields; ConfigError for a missing or wrong `fixed` one."""
  out: dict[str, Any] = {}
  for name, field in direct.items():
    if name not in section:
      _fail(name, "missing", label)
    out[field] = section[name]
  for name, want in fixed.items():
    if name in section and section[name] != want:
      _fail(name, f"{section[name]!r}: k3jax's {what} computes {want!r} only", label)
  return out


def mla_layers(num_layers: int, every: int, final: bool) -> list[int]:
  """The 1-based MLA layers of k3jax's pattern (`k3.layer_plan`)."""
  return [i for i in range(1, num_layers + 1) if i % every == 0 or (final and i == num_layers)]


def text_config_of(config: dict) -> dict:
  """The text model's config: `text_config` of the release's top level, or a bare one."""
  return config.get("text_config", config)


def model_fields(config: dict) -> dict[str, Any]:
  """{dotted `model.` field: value} of the release's config.json; ConfigError if inexpressible."""
  t = text_config_of(config)
  out = _read(t, DIRECT, FIXED, "text_config", "model")
  if t.get("num_key_value_heads", t["num_attention_heads"]) != t["num_attention_heads"]:
    _fail("num_key_value_heads", f"{t['num_key_value_heads']} != num_attention_heads "
          f"{t['num_attention_heads']}: MLA here has one key and value per head")
  if out["moe.num_shared"] and "moe_intermediate_size" in t:
    out["moe.shared_dim"] = t["moe_intermediate_size"]   # the release's shared experts' width
  linear = t.get("linear_attn_config")
  if not isinstance(linear, dict):
    _fail("linear_attn_config", "missing: it names the KDA layers and their sizes")
  for name, field in LINEAR.items():
    if name not in linear:
      _fail(f"linear_attn_config.{name}", "missing")
    out[field] = linear[name]
  if linear["gate_lower_bound"] is None:
    _fail("linear_attn_config.gate_lower_bound", "None (Kimi Linear's softplus gate): K3 "
          "checkpoints bound the gate")
  out["kda.gate"] = "bounded"
  if linear.get("use_full_rank_gate", True) is not True:
    _fail("linear_attn_config.use_full_rank_gate", "k3jax's KDA has a full-rank output gate")
  out["kda.gate_rank"] = linear["head_dim"]        # f_a_proj: d -> head_dim in the release
  n = t["num_hidden_layers"]
  full = sorted(linear.get("full_attn_layers", []))
  kda = sorted(linear.get("kda_layers", []))
  if sorted(full + kda) != list(range(1, n + 1)):
    _fail("linear_attn_config.full_attn_layers", f"with kda_layers they must list layers "
          f"1..{n} once each")
  if not full:
    _fail("linear_attn_config.full_attn_layers", "empty: k3jax needs MLA every m layers")
  every, final = full[0], full[-1] == n
  if full != mla_layers(n, every, final):
    _fail("linear_attn_config.full_attn_layers", f"{full} are not the multiples of "
          f"{every} (and the last layer): k3jax cannot express it")
  out["mla_every"], out["final_mla"] = every, final
  out["ffn.activation"] = "situ_glu"
  return out


def vision_fields(config: dict) -> dict[str, Any]:
  """{k3jax model field: value} of the release's `vision_config` ({} without one)."""
  v = config.get("vision_config")
  if v is None:
    return {}
  fail = lambda name, msg: _fail(name, msg, "vision_config")   # noqa: E731
  out = _read(v, VISION, VISION_FIXED, "vision_config", "tower")
  if v.get("init_pos_emb_width", v["init_pos_emb_height"]) != v["init_pos_emb_height"]:
    fail("init_pos_emb_width", "k3jax's position table is square")
  merge = v.get("merge_kernel_size", [2, 2])
  if len(merge) != 2 or merge[0] != merge[1]:
    fail("merge_kernel_size", f"{merge}: k3jax merges square windows")
  heads = v["vt_num_attention_heads"]
  inner = v.get("qkv_hidden_size", v["vt_hidden_size"])
  if inner % heads:
    fail("qkv_hidden_size", f"{inner} does not split into {heads} heads")
  if v.get("mm_hidden_size") not in (None, v["vt_hidden_size"]):
    fail("mm_hidden_size", "k3jax's projector reads the tower's width")
  text = text_config_of(config)
  if v.get("text_hidden_size", text.get("hidden_size")) != text.get("hidden_size"):
    fail("text_hidden_size", "the projector must end at the text model's hidden_size")
  if v.get("projector_ln_eps", text.get("rms_norm_eps")) != text.get("rms_norm_eps"):
    fail("projector_ln_eps", "k3jax's projector norm uses the text model's rms_norm_eps")
  out.update({"vision.head_dim": inner // heads, "vision.merge": merge[0],
              "vision.rope_2d": True,
              "vision.projector_hidden": -1, "vision.projector_norm": "post",
              "vision.projector_act": "gelu"})
  return out


def vision_config(model: ml_collections.ConfigDict) -> dict:
  """The release's vision_config for k3jax's tower (ConfigError for a form it lacks)."""
  v = model.vision
  try:
    from k3jax.convert.vision_layout import check_release_form  # noqa: PLC0415
    check_release_form(v)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  out = {name: v[field.removeprefix("vision.")] for name, field in VISION.items()}
  out.update(VISION_FIXED)
  out.update(init_pos_emb_width=v.pos_grid, qkv_hidden_size=v.num_heads * v.head_dim,
             merge_kernel_size=[v.merge, v.merge], mm_hidden_size=None,
             projector_ln_eps=model.norm_eps, text_hidden_size=model.d_model)
  return out


def apply(cfg: ml_collections.ConfigDict, config: dict) -> ml_collections.ConfigDict:
  """cfg with its `model.` fields set from the release's config.json."""
  for field, value in {**model_fields(config), **vision_fields(config)}.items():
    node = cfg.model
    *path, last = field.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return cfg


def text_config(model: ml_collections.ConfigDict, *, quantized: bool = True) -> dict:
  """The release's text_config for a k3jax model config."""
  def get(field):
    node = model
    for part in field.split("."):
      node = node[part]
    return node

  if model.ffn.activation != "situ_glu" or model.kda.gate != "bounded":
    raise ConfigError("config.model: the release's format holds SiTU-GLU FFNs and the "
                      "bounded KDA gate only")
  if model.moe.num_shared and model.moe.shared_dim != model.moe.expert_dim:
    raise ConfigError(f"config.model.moe.shared_dim {model.moe.shared_dim}: the release's "
                      f"format gives shared experts the routed width {model.moe.expert_dim}")
  if model.kda.gate_rank != model.kda.head_dim:
    raise ConfigError(f"config.model.kda.gate_rank {model.kda.gate_rank}: the release's "
                      f"format has the decay rank = head_dim {model.kda.head_dim}")
  t = {name: get(field) for name, field in DIRECT.items()}
  t.update(FIXED)
  t["num_key_value_heads"] = model.mla.num_heads
  n = model.num_layers
  full = mla_layers(n, model.mla_every, model.final_mla)
  t["linear_attn_config"] = {
      "full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full],
      **{name: get(field) for name, field in LINEAR.items()}, "use_full_rank_gate": True}
  t.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"],
           dtype="bfloat16")
  if quantized:
    t["quantization_config"] = QUANTIZATION
  return t

"""k3jax.convert.layout: k3jax's text-model parameters as the released K3's tensors and back.
A 9-layer model with every kind of layer (dense and MoE FFN, KDA and MLA mixers, scanned
cycles and a suffix) becomes tensors with the release's names, dtypes and shapes; written
to safetensors and read back per box it gives the parameters again (bf16-rounded where the
release stores bf16, on the MXFP4 grid for the routed experts), and those export to the
same bytes."""

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from k3jax.config import base_config
from k3jax.convert import importer, layout, stream
from k3jax.convert import safetensors as st
from k3jax.model import mxfp4
from k3jax.model.k3 import K3Model

L = "language_model.model.layers."
# The release's tensors of one layer of each kind (suffixes under layers.{i}.), by kind
COMMON = {"input_layernorm.weight": "BF16", "post_attention_layernorm.weight": "BF16",
          "self_attention_res_proj.weight": "BF16", "self_attention_res_norm.weight": "BF16",
          "mlp_res_proj.weight": "BF16", "mlp_res_norm.weight": "BF16"}
KDA = {f"self_attn.{n}": "BF16" for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                          "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
                                          "g_proj.weight", "o_proj.weight")}
KDA.update({f"self_attn.{n}": "F32" for n in ("q_conv1d.weight", "k_conv1d.weight",
                                              "v_conv1d.weight", "A_log", "dt_bias",
                                              "o_norm.weight")})
MLA = {f"self_attn.{n}.weight": "BF16" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj",
                                                 "kv_a_proj_with_mqa", "kv_a_layernorm",
                                                 "kv_b_proj", "g_proj", "o_proj")}
DENSE = {f"mlp.{n}_proj.weight": "BF16" for n in ("gate", "up", "down")}
MOE = {"block_sparse_moe.gate.weight": "BF16", "block_sparse_moe.gate.e_score_correction_bias":
       "F32", **{f"block_sparse_moe.{n}.weight": "BF16" for n in (
           "routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj",
           "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj")}}


def small():
  m = base_config().model
  m.vocab_size, m.d_model, m.num_layers, m.param_dtype = 96, 64, 9, "float32"
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank = 2, 32, 32
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 2, 32, 32
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = 16, 16, 16
  m.ffn.hidden_dim = 64
  e = m.moe
  e.num_experts, e.top_k, e.expert_dim, e.latent_dim, e.shared_dim = 4, 2, 64, 32, 64
  m.attn_res.block_layers = 4
  return m


def getter(params):
  return lambda path, c: params[path] if c is None else params[path][c]


def random_params(m):
  state = nnx.state(nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  params = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = importer.param_path(path).removesuffix("/.value")
    params[name] = rng.standard_normal(leaf.shape).astype(np.float32)
  return params


def expected_names(m):
  kinds = {}
  for i in range(m.num_layers):
    mixer = MLA if (i + 1) % 4 == 0 or i + 1 == m.num_layers else KDA
    ffn = DENSE if i == 0 else MOE
    kinds.update({f"{L}{i}.{k}": v for k, v in {**COMMON, **mixer, **ffn}.items()})
    if ffn is MOE:
      kinds.update({f"{L}{i}.block_sparse_moe.experts.{e}.{w}.{part}": "U8"
                    for e in range(4) for w in ("w1", "w2", "w3")
                    for part in ("weight_packed", "weight_scale")})
  kinds.update({"language_model.model.embed_tokens.weight": "BF16",
                "language_model.lm_head.weight": "BF16",
                "language_model.model.norm.weight": "BF16",
                "language_model.model.output_attn_res_proj.weight": "BF16",
                "language_model.model.output_attn_res_norm.weight": "BF16"})
  return kinds


def test_parameters_become_the_release_tensors_and_come_back(tmp_path):
  m = small()
  params = random_params(m)
  assert set(params) == set(layout.bindings(m))           # every parameter has its place
  release = dict(layout.tensors(m, getter(params)))
  want = expected_names(m)
  assert {k: st.NAMES[v.dtype] for k, v in release.items()} == want
  assert layout.expected(m) == {k: (v.dtype, v.shape) for k, v in release.items()}
  shapes = {"self_attn.q_proj.weight": (64, 64), "self_attn.q_conv1d.weight": (64, 1, 4),
            "self_attn.A_log": (32,), "self_attn.dt_bias": (64,), "self_attn.o_norm.weight": (32,),
            "self_attn.b_proj.weight": (2, 64), "self_attn.f_a_proj.weight": (32, 64),
            "self_attention_res_proj.weight": (1, 64)}
  for suffix, shape in shapes.items():
    assert release[f"{L}1.{suffix}"].shape == shape, suffix
  assert release[f"{L}3.self_attn.q_b_proj.weight"].shape == (2 * 32, 32)
  assert release[f"{L}3.self_attn.kv_b_proj.weight"].shape == (2 * 32, 32)
  assert release[f"{L}3.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 16, 64)
  assert release[f"{L}1.block_sparse_moe.shared_experts.gate_proj.weight"].shape == (128, 64)
  assert release[f"{L}1.block_sparse_moe.shared_experts.down_proj.weight"].shape == (64, 128)
  assert release[f"{L}1.block_sparse_moe.experts.3.w2.weight_packed"].shape == (32, 32)
  assert release[f"{L}1.block_sparse_moe.experts.3.w2.weight_scale"].shape == (32, 2)
  assert not release[f"{L}1.self_attn.A_log"][2:].any()

  path = str(tmp_path / "model.safetensors")
  st.write(path, release)
  infos = st.read_header(path)[0]

  def source(name):
    if name.endswith("weight_packed"):
      return stream.from_mxfp4(infos[name], infos[name.replace("_packed", "_scale")])
    return stream.from_file(infos[name])

  loaded = {}
  for p, src in layout.sources(m, source).items():
    full = tuple((0, n) for n in params[p].shape)
    loaded[p] = src(full)
    if p.endswith(("ffn/w_g", "ffn/w_u", "ffn/w_d")):          # routed experts
      want_p = np.asarray(mxfp4.fake_quantize(params[p], axis=-2))
    elif p.endswith(("A_log", "dt_bias", "_conv", "o_norm/weight", "ffn/bias")):
      want_p = params[p]                                        # fp32 in the release
    else:
      want_p = params[p].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(loaded[p], want_p, err_msg=p)
  box = ((0, 1), (8, 40), (0, 1), (0, 32))                      # one cycle, rows, a head
  np.testing.assert_array_equal(layout.sources(m, source)["cycles/layers/0/mixer/q_proj/kernel"](
      box), loaded["cycles/layers/0/mixer/q_proj/kernel"][:1, 8:40, :1, :32])

  again = dict(layout.tensors(m, getter(loaded)))
  for name, array in release.items():
    if name.endswith(("weight_packed", "weight_scale")):
      continue
    assert again[name].tobytes() == array.tobytes(), name
  for name in release:
    if name.endswith("weight_packed"):
      scale = name.replace("_packed", "_scale")
      np.testing.assert_array_equal(mxfp4.dequantize(again[name], again[scale]),
                                    mxfp4.dequantize(release[name], release[scale]))


def test_imported_weights_compute_what_the_release_computes():
  """The k3jax model given the release's tensors (through layout.sources) = the release's
  equations in float64 NumPy (tests/release_reference.py, written from the engines, not
  from k3jax) on the same tensors: logits within 1e-4 relative, fp32, 12 tokens through 9
  layers (KDA, MLA, dense FFN, MoE, AttnRes blocks of 4 layers)."""
  import jax.numpy as jnp  # noqa: PLC0415
  import release_reference  # noqa: PLC0415

  from k3jax.convert import hf_config  # noqa: PLC0415
  m = small()
  m.dtype, m.moe.dispatch, m.mla.attention = "float32", "dropless", "dense"
  release = dict(layout.tensors(m, getter(random_params(m))))
  arrays = {}
  for name, a in release.items():
    if name.endswith("weight_packed"):
      arrays[name] = mxfp4.dequantize(a, release[name.replace("_packed", "_scale")])
    elif not name.endswith("weight_scale"):
      arrays[name] = np.asarray(a, np.float32)

  def source(name):
    a = arrays.get(name)
    return lambda box: a if box is None else a[tuple(slice(x, y) for x, y in box)]

  model = nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  loaded = layout.sources(m, source)
  for path, var in flat:
    key = "/".join(map(str, path))
    var.set_value(jnp.asarray(loaded[key](tuple((0, n) for n in var.get_value().shape))))
  model = nnx.merge(graphdef, nnx.from_flat_state(flat))
  tokens = np.random.default_rng(5).integers(0, m.vocab_size, 12)
  got, _ = model(jnp.asarray(tokens[None]), jnp.ones((1, 12), jnp.int32))
  config = hf_config.text_config(m, quantized=False)
  want = release_reference.logits(arrays, config, tokens)
  np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-4,
                             atol=1e-4 * np.abs(want).max())

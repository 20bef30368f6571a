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
    loaded[p] = np.asarray(stream.materialize(src(full)))
    if p.endswith(("ffn/w_g", "ffn/w_u", "ffn/w_d")):          # routed experts
      want_p = np.asarray(mxfp4.fake_quantize(params[p], axis=-2))
    elif p.endswith(("A_log", "dt_bias", "_conv", "o_norm/weight", "ffn/bias")):
      want_p = params[p]                                        # fp32 in the release
    else:
      want_p = params[p].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(loaded[p], want_p, err_msg=p)
  box = ((0, 1), (8, 40), (0, 1), (0, 32))                      # one cycle, rows, a head
  q_proj = "cycles/layers/0/mixer/q_proj/kernel"
  np.testing.assert_array_equal(stream.materialize(layout.sources(m, source)[q_proj](box)),
                                loaded[q_proj][:1, 8:40, :1, :32])

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


def release_arrays(m):
  """The release's tensors of random parameters of `m`, as fp32 (MXFP4 dequantized, under
  the packed name)."""
  release = dict(layout.tensors(m, getter(random_params(m))))
  arrays = {}
  for name, a in release.items():
    if name.endswith("weight_packed"):
      arrays[name] = mxfp4.dequantize(a, release[name.replace("_packed", "_scale")])
    elif not name.endswith("weight_scale"):
      arrays[name] = np.asarray(a, np.float32)
  return arrays


def model_from_release(m, arrays):
  """K3Model of config `m` with every parameter read from `arrays` through layout.sources."""
  import jax.numpy as jnp  # noqa: PLC0415

  def source(name):   # (an MXFP4 weight's scales: already in its dequantized array)
    a = arrays.get(name)
    return lambda box: a if box is None else a[tuple(slice(x, y) for x, y in box)]

  graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0))))
  flat = nnx.to_flat_state(state)
  loaded = layout.sources(m, source)
  for path, var in flat:
    key = "/".join(map(str, path))
    var.set_value(jnp.asarray(stream.materialize(
        loaded[key](tuple((0, n) for n in var.get_value().shape)))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def test_imported_weights_compute_what_the_release_computes():
  """The k3jax model given the release's tensors (through layout.sources) = the release's
  equations in float64 NumPy (tests/release_reference.py, written from the engines, not
  from k3jax) on the same tensors: logits within 1e-4 relative, fp32, 12 tokens through 9
  layers (KDA, MLA, dense FFN, MoE, AttnRes blocks of 4 layers)."""
  import jax.numpy as jnp  # noqa: PLC0415
  import release_reference  # noqa: PLC0415

  from k3jax.convert import hf_config  # noqa: PLC0415
  m = small()
  m.dtype, m.moe.dispatch, m.mla.attention = "float32", "dropless", "reference"
  arrays = release_arrays(m)
  model = model_from_release(m, arrays)
  tokens = np.random.default_rng(5).integers(0, m.vocab_size, 12)
  got, _ = model(jnp.asarray(tokens[None]), jnp.ones((1, 12), jnp.int32))
  config = hf_config.text_config(m, quantized=False)
  want = release_reference.logits(arrays, config, tokens)
  np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-4,
                             atol=1e-4 * np.abs(want).max())


def with_vision(m):
  v = m.vision
  v.enabled, v.attention = True, "reference"
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim = 2, 16, 2, 8, 32
  v.patch_size, v.pos_grid, v.max_patches, v.max_media, v.placeholder_id = 2, 4, 32, 2, 90
  return m


def test_vision_tensors_are_the_releases_and_come_back():
  """With the tower on: the release's vision names, dtypes and shapes (the conv patch
  embedding [width, 3, P, P], the fused wqkv, the projector's two layers and post norm), the
  tower's parameters back from them (bf16-rounded), and the same bytes exported again."""
  m = with_vision(small())
  params = random_params(m)
  assert set(params) == set(layout.bindings(m))
  release = dict(layout.tensors(m, getter(params)))
  vision = {k: (st.NAMES[a.dtype], a.shape) for k, a in release.items()
            if k.startswith(("vision_tower.", "mm_projector."))}
  b = "vision_tower.encoder.blocks."
  assert vision == {
      "vision_tower.patch_embed.proj.weight": ("BF16", (16, 3, 2, 2)),
      "vision_tower.patch_embed.pos_emb.weight": ("BF16", (4, 4, 16)),
      "vision_tower.encoder.final_layernorm.weight": ("BF16", (16,)),
      "mm_projector.proj.0.weight": ("BF16", (64, 64)),
      "mm_projector.proj.2.weight": ("BF16", (64, 64)),
      "mm_projector.post_norm.weight": ("BF16", (64,)),
      **{f"{b}{i}.{n}": ("BF16", shape) for i in range(2) for n, shape in (
          ("norm0.weight", (16,)), ("norm1.weight", (16,)), ("wqkv.weight", (48, 16)),
          ("wo.weight", (16, 16)), ("mlp.fc0.weight", (32, 16)), ("mlp.fc1.weight", (16, 32)))}}
  # q, k, v of block 1, head 1 are rows 8-15 of their third of wqkv
  wq = params["vision/blocks/wq/kernel"][1][:, 1, :]
  wv = params["vision/blocks/wv/kernel"][1][:, 1, :]
  qkv = np.asarray(release[f"{b}1.wqkv.weight"], np.float32)
  np.testing.assert_array_equal(qkv[8:16], wq.T.astype(ml_dtypes.bfloat16).astype(np.float32))
  np.testing.assert_array_equal(qkv[40:48], wv.T.astype(ml_dtypes.bfloat16).astype(np.float32))
  arrays = {k: np.asarray(a, np.float32) for k, a in release.items()
            if not k.endswith(("weight_packed", "weight_scale"))}
  loaded = {p: np.asarray(stream.materialize(src(tuple((0, n) for n in params[p].shape))))
            for p, src in
            layout.sources(m, lambda n: (lambda box, a=arrays.get(n): a if box is None else
                                         a[tuple(slice(x, y) for x, y in box)])).items()
            if p.startswith("vision/")}
  for p, got in loaded.items():
    np.testing.assert_array_equal(got, params[p].astype(ml_dtypes.bfloat16).astype(np.float32),
                                  err_msg=p)
  again = dict(layout.tensors(m, getter({**params, **loaded})))
  for name in vision:
    assert again[name].tobytes() == release[name].tobytes(), name


def test_imported_tower_sees_an_image_as_the_release_does():
  """The k3jax model with the tower on, its parameters read from the release's tensors:
  the features of a 12 x 8-pixel picture (6 x 4 patches of 2 px, 2-D RoPE, bilinear
  positions from a 4 x 4 table, 2 x 2 merge, projector) equal the release's equations in
  float64 NumPy (tests/release_reference.py) within 1e-4, and so do the logits of a text
  whose six placeholders they replace."""
  import jax.numpy as jnp  # noqa: PLC0415
  import release_reference  # noqa: PLC0415

  from k3jax.convert import hf_config  # noqa: PLC0415
  from k3jax.media import pack, patchify  # noqa: PLC0415
  m = with_vision(small())
  m.dtype, m.moe.dispatch, m.mla.attention = "float32", "dropless", "reference"
  v = m.vision
  arrays = release_arrays(m)
  model = model_from_release(m, arrays)
  image = np.random.default_rng(6).uniform(-1, 1, (12, 8, 3)).astype(np.float32)
  media, counts = pack([patchify(image, patch_size=2, merge=2)], max_patches=v.max_patches,
                       max_media=v.max_media, merge=v.merge, temporal_pool=v.temporal_pool)
  assert counts == [6]
  want = release_reference.media_features(arrays, image[None].astype(np.float64), patch=2,
                                           heads=v.num_heads, block_eps=v.norm_eps,
                                           projector_eps=m.norm_eps)
  got = np.asarray(model.embed_images(media), np.float64)[:6]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

  tokens = np.random.default_rng(7).integers(0, 80, 12)
  tokens[3:9] = v.placeholder_id
  logits, _ = model(jnp.asarray(tokens[None]), jnp.ones((1, 12), jnp.int32), media)
  config = hf_config.text_config(m, quantized=False)
  ref = release_reference.logits(arrays, config, tokens, image=(v.placeholder_id, want))
  np.testing.assert_allclose(np.asarray(logits[0], np.float64), ref, rtol=1e-4,
                             atol=1e-4 * np.abs(ref).max())


def test_imported_tower_pools_a_video_chunk_as_the_release_does():
  """A video of model.vision.temporal_pool frames (the release's chunk: it averages a
  chunk's frames after the tower): the sincos frame embedding, attention across the
  frames, the 2-D RoPE per frame, the windows averaged over the frames: the release's
  features within 1e-4."""
  import release_reference  # noqa: PLC0415

  from k3jax.media import pack, patchify_video  # noqa: PLC0415
  m = with_vision(small())
  m.dtype = "float32"
  v = m.vision
  v.max_patches = 16 * v.temporal_pool
  arrays = release_arrays(m)
  model = model_from_release(m, arrays)
  frames = np.random.default_rng(8).uniform(-1, 1, (v.temporal_pool, 8, 8, 3)).astype(
      np.float32)
  media, counts = pack([patchify_video(frames, patch_size=2, merge=2,
                                       temporal_pool=v.temporal_pool)],
                       max_patches=v.max_patches, max_media=v.max_media, merge=v.merge,
                       temporal_pool=v.temporal_pool)
  assert counts == [4]
  want = release_reference.media_features(arrays, frames.astype(np.float64), patch=2,
                                           heads=v.num_heads, block_eps=v.norm_eps,
                                           projector_eps=m.norm_eps)
  got = np.asarray(model.embed_images(media), np.float64)[:4]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

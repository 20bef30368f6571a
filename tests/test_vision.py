"""MoonViT-V2: packed vs alone, position interpolation vs numpy, merge / pooling by
construction, patchify errors, the full tower's size, placeholder insertion, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config, random_model, set_field
from flax import nnx

from k3jax import config as k3config
from k3jax.axes import axis_names
from k3jax.media import pack, patchify, patchify_video
from k3jax.model import K3Model
from k3jax.model.vision import Projector, VisionTower, insert_features, param_counts
from k3jax.model.vision_pos import grid_embedding, rope_2d

P, M, TP, G = 2, 2, 2, 4   # patch px, merge, temporal pool, position grid of the test tower
N, MEDIA = 96, 4           # packed buffer: patches, items


def small_model_cfg():
  m = k3config.base_config().model
  m.d_model, m.dtype, m.param_dtype = 24, "float32", "float32"
  v = m.vision
  v.enabled = True
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim = 2, 16, 2, 8, 32
  v.patch_size, v.merge, v.temporal_pool, v.pos_grid = P, M, TP, G
  v.max_patches, v.max_media = N, MEDIA
  return m


@pytest.fixture(scope="module")
def tower():
  model = random_model(small_model_cfg(), model_cls=VisionTower)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda s, media: nnx.merge(graphdef, s)(media))
  return model, lambda media: np.asarray(fwd(state, media))


def pack_items(items):
  return pack(items, max_patches=N, max_media=MEDIA, merge=M, temporal_pool=TP)


def test_packed_items_equal_each_alone(tower):
  """Two images of different shapes and a 2-frame video packed into one buffer give each
  item the features it gets alone (attention and positions confined to the item)."""
  _, forward = tower
  rng = np.random.default_rng(0)
  a = patchify(rng.integers(0, 256, (8, 12, 3), dtype=np.uint8), patch_size=P, merge=M)
  b = patchify(rng.standard_normal((12, 8, 3)).astype(np.float32), patch_size=P, merge=M)
  vid = patchify_video(rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8), patch_size=P,
                       merge=M, temporal_pool=TP)
  assert a[1] == (4, 6) and b[1] == (6, 4) and vid[1] == (2, 4, 4)
  media, tokens = pack_items([a, b, vid])
  assert tokens == [6, 6, 4]
  packed = forward(media)
  assert packed.shape == (N // M**2, 24)
  start = 0
  for item, n in zip((a, b, vid), tokens):
    alone = forward(pack_items([item])[0])
    np.testing.assert_allclose(packed[start:start + n], alone[:n], rtol=1e-5, atol=1e-5)
    assert np.all(alone[n:] == 0)
    start += n
  assert np.all(packed[start:] == 0) and np.abs(packed[:start]).min(axis=-1).max() > 0
  # Bidirectional within an item: the last patch of image a changes its first token; the
  # other items do not move.
  changed = media.patches.copy()
  changed[23] += 1.0
  out = forward(media._replace(patches=changed))
  assert np.abs(out[0] - packed[0]).max() > 1e-3
  np.testing.assert_allclose(out[6:], packed[6:], rtol=1e-5, atol=1e-5)


def tent(n_out, n_in):
  """Bilinear resize n_in -> n_out as a matrix [n_out, n_in]: half-pixel centres, edge
  clamped, each output the tent max(0, 1 - |src - s|) over inputs s."""
  src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
  return np.maximum(0.0, 1.0 - np.abs(src[:, None] - np.arange(n_in)[None, :]))


def full_grid(h, w):
  r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  r, c = r.reshape(-1), c.reshape(-1)
  return r, c, np.full_like(r, h), np.full_like(c, w)


@pytest.mark.parametrize("h,w", [(G, G), (6, 3), (2, 7), (1, 1)])
def test_position_interpolation_vs_numpy(h, w):
  rng = np.random.default_rng(1)
  table = rng.standard_normal((G, G, 5)).astype(np.float32)
  rows_cols = tuple(jnp.asarray(x) for x in full_grid(h, w))
  got = np.asarray(grid_embedding(jnp.asarray(table), *rows_cols)).reshape(h, w, 5)
  want = np.einsum("ia,abd,jb->ijd", tent(h, G), table, tent(w, G))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if (h, w) == (G, G):   # the native grid reads the table itself, exactly
    assert np.array_equal(got, table)


def coded_image(h, w, offset=0.0):
  """An image of h x w patches whose every pixel in patch (r, c) is offset + 100 r + c."""
  r, c = np.meshgrid(np.arange(h * P) // P, np.arange(w * P) // P, indexing="ij")
  return np.repeat((offset + 100.0 * r + c)[..., None], 3, axis=-1).astype(np.float32)


def test_merge_concatenates_the_2x2_window_and_pools_frame_pairs(tower):
  """By construction: a token holds patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1)
  of its image, in that order; a video token is the mean of the same window in frames
  2g and 2g+1."""
  model, _ = tower
  image = patchify(coded_image(4, 6), patch_size=P, merge=M)
  frames = np.stack([coded_image(2, 4, offset=1000.0 * f) for f in range(4)])
  video = patchify_video(frames, patch_size=P, merge=M, temporal_pool=TP)
  media, tokens = pack_items([image, video])
  assert tokens == [6, 4]
  seg = media.segment_ids > 0
  code = 100 * media.coords[:, 1] + media.coords[:, 2] + 1000 * media.coords[:, 0]
  np.testing.assert_array_equal(media.patches[seg, 0], code[seg])   # coords name each patch
  z = np.asarray(model.merge_pool(jnp.asarray(media.patches[:, :1]), media.pool_ids))
  want_image = [[100 * 2 * i + 2 * j + d for d in (0, 1, 100, 101)]
                for i in range(2) for j in range(3)]
  np.testing.assert_array_equal(z[:6], want_image)
  want_video = [[1000 * (2 * g + 0.5) + 100 * 2 * i + 2 * j + d for d in (0, 1, 100, 101)]
                for g in range(2) for i in range(1) for j in range(2)]
  np.testing.assert_allclose(z[6:10], want_video)
  assert np.all(z[10:] == 0)
  # Positions: the image reads the grid resized to 4 x 6; a video frame adds the fixed
  # sin-cos embedding of its index (dims: sin of width // 2 frequencies, then cos).
  pos = np.asarray(model.positions(media))
  table = np.asarray(model.pos_table[...])
  want = np.einsum("ia,abd,jb->ijd", tent(4, G), table, tent(6, G))
  c = media.coords
  np.testing.assert_allclose(pos[:24], want[c[:24, 1], c[:24, 2]], rtol=1e-5, atol=1e-6)
  freq = 10_000.0 ** (-np.arange(8) / 8)
  sincos = lambda f: np.concatenate([np.sin(f * freq), np.cos(f * freq)])  # noqa: E731
  spatial = np.einsum("ia,abd,jb->ijd", tent(2, G), table, tent(4, G))
  for n in range(24, 56):
    f, r, col = c[n]
    np.testing.assert_allclose(pos[n], spatial[r, col] + sincos(f), rtol=1e-5, atol=1e-5)
  # And for any features: the mean of the two frames' concatenated windows.
  x = np.random.default_rng(2).standard_normal((N, 3)).astype(np.float32)
  z = np.asarray(model.merge_pool(jnp.asarray(x), media.pool_ids))
  windows = x[24:56].reshape(8, 12)                      # the video's 8 windows, merge order
  np.testing.assert_allclose(z[6:10], (windows[0::2] + windows[1::2]) / 2, rtol=1e-6)


def test_patchify_pads_scales_and_refuses_bad_images():
  patches, (h, w) = patchify(np.full((30, 44, 3), 255, np.uint8), max_patches=16)
  assert (h, w) == (4, 4) and patches.shape == (16, 14 * 14 * 3)   # padded to 56 x 56 px
  img = patches[:, :].reshape(2, 2, 2, 2, 14, 14, 3)   # [i, j, a, b] windows in merge order
  img = img.transpose(0, 2, 4, 1, 3, 5, 6).reshape(56, 56, 3)
  assert np.all(img[:30, :44] == 1.0) and np.all(img[30:] == 0) and np.all(img[:, 44:] == 0)
  with pytest.raises(ValueError, match="too small"):
    patchify(np.zeros((27, 100, 3), np.uint8))
  with pytest.raises(ValueError, match="too large"):
    patchify(np.zeros((28 * 5, 28 * 5, 3), np.uint8), max_patches=99)
  with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
    patchify(np.zeros((56, 56, 4), np.uint8))
  with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
    patchify(np.zeros((56, 56), np.uint8))
  with pytest.raises(ValueError, match="temporal_pool=2"):
    patchify_video(np.zeros((3, 56, 56, 3), np.uint8))
  small = patchify(np.zeros((4, 4, 3), np.float32), patch_size=P, merge=M)
  with pytest.raises(ValueError, match="max_media=4"):
    pack_items([small] * 5)
  with pytest.raises(ValueError, match="100 patches, more than max_patches=96"):
    pack_items([patchify(np.zeros((20, 20, 3), np.float32), patch_size=P, merge=M)])


def test_full_tower_parameter_count():
  """k3_full's tower from eval_shape = the count from its config, ~401M without the
  projector (vision.py docstring)."""
  m = k3config.base_config().model
  m.vision.enabled = True
  v = m.vision
  model = nnx.eval_shape(lambda: VisionTower(m, rngs=nnx.Rngs(0)))
  sizes = {"tower": 0, "projector": 0}
  for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    sizes["projector" if path[0] == "projector" else "tower"] += int(np.prod(p.get_value().shape))
  inner = v.num_heads * v.head_dim
  per_layer = v.width * 3 * inner + inner * v.width + 2 * v.width * v.mlp_dim + 2 * v.width
  tower = (v.num_layers * per_layer + 3 * v.patch_size**2 * v.width
           + v.pos_grid**2 * v.width + v.width)
  merged = 4 * v.width   # the released projector: merged -> merged -> d_model, then its norm
  projector = merged * merged + merged * m.d_model + m.d_model
  assert sizes == param_counts(m) == {"tower": tower, "projector": projector}
  assert abs(tower / 401e6 - 1) < 2e-3, tower
  assert projector == 46_144_512
  # Every matrix is a Muon matrix (q/k/v per head), every axis has a known logical name.
  known = {"embed", "heads", "head_dim", "mlp", "layers", None}
  for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert set(axis_names(p)) <= known, path
    meta = p.get_metadata()
    if path[-1] == "kernel":
      assert meta["muon"] == "matrix", path
      assert ("head" in meta["muon_roles"]) == (path[-2] in ("wq", "wk", "wv")), path


def test_insert_features_writes_exactly_the_placeholders():
  rng = np.random.default_rng(3)
  ph = 7
  tokens = rng.integers(0, 6, (2, 9)).astype(np.int32)
  where = [(0, 1), (0, 2), (0, 8), (1, 0), (1, 5)]
  for b, t in where:
    tokens[b, t] = ph
  embeds = rng.standard_normal((2, 9, 4)).astype(np.float32)
  feats = rng.standard_normal((6, 4)).astype(np.float32)
  embeds_j, tokens_j = jnp.asarray(embeds), jnp.asarray(tokens)
  out = np.asarray(insert_features(embeds_j, tokens_j, jnp.asarray(feats), ph))
  want = embeds.copy()
  for k, (b, t) in enumerate(where):
    want[b, t] = feats[k]
  np.testing.assert_array_equal(out, want)
  # More placeholders than feature rows: the extra ones keep their embedding.
  out = np.asarray(insert_features(embeds_j, tokens_j, jnp.asarray(feats[:3]), ph))
  want[1, 0], want[1, 5] = embeds[1, 0], embeds[1, 5]
  np.testing.assert_array_equal(out, want)


def test_model_builds_the_tower_and_embeds_images():
  cfg = micro_config()
  assert nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0))).vision is None
  small = small_model_cfg()
  for field in ("num_layers", "width", "num_heads", "head_dim", "mlp_dim", "patch_size",
                "pos_grid", "max_patches", "max_media"):
    cfg.model.vision[field] = small.vision[field]
  cfg.model.vision.enabled, cfg.model.vision.placeholder_id = True, 5
  k3config.validate(cfg)
  model = random_model(cfg.model)
  media, tokens = pack_items([patchify(np.ones((8, 8, 3), np.float32), patch_size=P, merge=M)])
  text = np.array([[1, 5, 5, 2, 5, 5, 3]], np.int32)
  assert tokens == [4]
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, text, media):
    model = nnx.merge(graphdef, state)
    return model.embed_images(media), model.embed_with_images(text, media)

  feats, x = (np.asarray(y) for y in run(state, text, media))
  table = np.asarray(model.embed[...])
  np.testing.assert_allclose(x[0, [1, 2, 4, 5]], feats[:4], rtol=1e-6)
  np.testing.assert_array_equal(x[0, [0, 3, 6]], table[[1, 2, 3]])


@pytest.mark.parametrize("field,value,match", [
    ("model.vision.max_patches", 1_002, "multiple of merge\\*\\*2 \\* temporal_pool = 16"),
    ("model.vision.width", 0, "model.vision.width"),
    ("model.vision.projector_hidden", -2, "model.vision.projector_hidden"),
    ("model.vision.projector_norm", "both", "model.vision.projector_norm"),
    ("model.vision.projector_act", "relu", "model.vision.projector_act"),
    ("model.vision.norm_eps", 0.0, "model.vision.norm_eps"),
    ("model.vision.head_dim", 126, "2-D RoPE .* 126 is not a multiple of 4"),
    ("model.vision.placeholder_id", 163_840, "vocab_size=163840"),
    ("mesh.tensor", 8, "model.vision.num_heads=12"),
])
def test_vision_config_errors_name_the_field(field, value, match):
  c = k3config.base_config()
  c.model.vision.enabled = True
  set_field(c, field, value)
  with pytest.raises(k3config.ConfigError, match=match):
    k3config.validate(c)


def test_small_vocabulary_needs_its_own_placeholder():
  c = micro_config()
  k3config.validate(c)                      # off: the default id is not checked
  c.model.vision.enabled = True
  with pytest.raises(k3config.ConfigError, match="model.vision.placeholder_id"):
    k3config.validate(c)


def test_rope_2d_vs_complex_numpy():
  """The released tower's 2-D RoPE written with NumPy complex numbers: per head, channel
  pairs (2i, 2i + 1) as one complex number times exp(i angle), the angles
  [col f_0, row f_0, col f_1, row f_1, ...] with f_j = theta^(-4j / D)."""
  n, h, d, theta = 7, 3, 16, 10_000.0
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, h, d)).astype(np.float32)
  rows, cols = rng.integers(0, 40, n), rng.integers(0, 40, n)
  f = theta ** (-4.0 * np.arange(d // 4) / d)
  angle = np.stack([cols[:, None] * f, rows[:, None] * f], -1).reshape(n, 1, d // 2)
  want = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
  got = np.asarray(rope_2d(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(cols), theta))
  np.testing.assert_allclose(got[..., 0::2], want.real, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[..., 1::2], want.imag, rtol=1e-5, atol=1e-5)


def test_rope_2d_scores_depend_on_relative_places_only():
  """q . k after the RoPE is the same for every pair of patches the same (rows, cols)
  apart, and changes when the offset does (by row or by column)."""
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.standard_normal((1, 2, 32)), jnp.float32) for _ in range(2))

  def score(rq, cq, rk, ck):
    a = rope_2d(q, jnp.array([rq]), jnp.array([cq]))
    b = rope_2d(k, jnp.array([rk]), jnp.array([ck]))
    return np.asarray(jnp.sum(a * b, axis=-1))

  base = score(3, 5, 1, 2)
  np.testing.assert_allclose(score(13, 25, 11, 22), base, rtol=1e-4, atol=1e-5)
  assert not np.allclose(score(4, 5, 1, 2), base, atol=1e-3)   # another row offset
  assert not np.allclose(score(3, 6, 1, 2), base, atol=1e-3)   # another column offset


@pytest.mark.parametrize("norm,act", [("post", "gelu"), ("pre", "gelu_tanh")])
def test_projector_forms_vs_numpy(norm, act):
  """"post" + "gelu" (the release): RMSNorm(W_2 gelu_erf(W_1 z)); "pre" + "gelu_tanh":
  W_2 gelu_tanh(W_1 RMSNorm(z)). RMSNorm(x) = x / sqrt(mean x^2 + eps) * gain."""
  from math import erf  # noqa: PLC0415
  dim, hid, out, eps = 8, 12, 6, 1e-5
  proj = Projector(dim, hid, out, norm=norm, act=act, eps=eps, dtype=jnp.float32,
                   param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  proj.norm.weight[...] = jnp.asarray(1 + 0.1 * rng.standard_normal(proj.norm.weight.shape))
  z = rng.standard_normal((5, dim))
  w1, w2 = (np.asarray(w.kernel[...], np.float64) for w in (proj.w1, proj.w2))
  gain = np.asarray(proj.norm.weight[...], np.float64)

  def rms(x):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * gain

  def gelu(x):
    if act == "gelu":
      return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

  want = rms(gelu(z @ w1) @ w2) if norm == "post" else gelu(rms(z) @ w1) @ w2
  got = np.asarray(proj(jnp.asarray(z, jnp.float32)))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

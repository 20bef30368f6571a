"""Images into training: generated pictures match their captions, packed rows hold one
placeholder per image token and no loss on them, a packed batch embeds each picture as it
is embedded alone, the iterator resumes mid-stream, bad files say what is wrong, and a few
train steps with the tower are finite and reach its parameters."""

import json

import jax
import numpy as np
import pytest
from conftest import micro_config, random_model, set_field
from flax import nnx

from k3jax import config as k3config
from k3jax import data as k3data
from k3jax import parallel, program, steps
from k3jax.data import images
from k3jax.media import num_tokens, pack

PH, SEQ, BATCH = 258, 64, 4


def mm_config():
  """micro_config with a one-layer tower (14-px patches, 64 patches / 3 pictures a row) and
  generated 56-84 px pictures mixed 1:1 with the text corpus."""
  c = micro_config()
  c.model.vocab_size = 384   # byte tokenizer: 258 ids, then the placeholder
  v = c.model.vision
  v.enabled, v.placeholder_id = True, PH
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim, v.pos_grid = 1, 16, 2, 8, 32, 4
  v.max_patches, v.max_media = 64, 3
  c.train.seq_len, c.train.global_batch = SEQ, BATCH
  c.data.images.source = "generated"
  c.data.images.min_size, c.data.images.max_size = 56, 84
  return k3config.validate(c)


def spec(c):
  return k3data.MediaSpec.from_config(c.model.vision)


def batches(c, n, split="train", **kw):
  ds = k3data.make_dataset(c.data, seq_len=SEQ, global_batch=BATCH, seed=0, split=split,
                           media=spec(c), **kw)
  it = iter(ds)
  return [next(it) for _ in range(n)]


def test_generated_pictures_are_deterministic_and_match_their_captions():
  for i in range(40):
    image, text, facts = images.generate(0, "train", i)
    again, text2, _ = images.generate(0, "train", i)
    assert np.array_equal(image, again) and text == text2
    h, w, _ = image.shape
    assert 56 <= h <= 112 and 56 <= w <= 112 and image.dtype == np.uint8
    colour = np.array(images.COLOURS[facts["colour"]])
    drawn = np.any(image != images.BACKGROUND, axis=-1)
    assert np.all(image[drawn] == colour)                  # one colour, nothing else drawn
    ch, cw = h // 3, w // 3
    for cell in range(9):
      r, col = divmod(cell, 3)
      inside = drawn[r * ch:(r + 1) * ch, col * cw:(col + 1) * cw].sum()
      assert (inside > 0) == (cell in facts["cells"]), (i, cell)
    assert drawn.sum() == sum(drawn[r * ch:(r + 1) * ch, c * cw:(c + 1) * cw].sum()
                              for r, c in map(lambda k: divmod(k, 3), facts["cells"]))
    words = text.split()
    assert words[0] == images.COUNT_WORDS[facts["count"] - 1] and words[1] == facts["colour"]
    assert words[2].startswith(facts["shape"])
    if facts["count"] == 1:
      assert text.endswith(images.CELLS[facts["cells"][0]])
    else:
      assert len(words) == 3
  assert any(images.generate(0, "validation", i)[1] != images.generate(0, "train", i)[1]
             for i in range(5))
  counts = {images.generate(0, "train", i)[2]["count"] for i in range(40)}
  assert counts == {1, 2, 3, 4}


def test_rows_hold_one_placeholder_per_image_token_and_no_loss_on_them():
  c = mm_config()
  s = spec(c)
  got = batches(c, 4)
  shapes = k3data.feature_shapes(c.data, seq_len=SEQ, batch=BATCH, media=s)
  assert set(got[0]) == set(shapes)
  for name, (shape, dtype) in shapes.items():
    assert got[0][name].shape == shape and got[0][name].dtype == dtype, name
  pictures = text_pieces = 0
  for b in got:
    for r in range(BATCH):
      grids = b["media_grid_thw"][r]
      used = grids[grids[:, 0] > 0]
      tokens = sum(num_tokens(tuple(g), s.merge, s.temporal_pool) for g in used)
      is_ph = b["inputs"][r] == PH
      assert is_ph.sum() == tokens                          # one placeholder per feature row
      assert (b["media_pool_ids"][r] < tokens).sum() == tokens   # one 2x2 window each
      assert np.all(b["weights"][r][b["targets"][r] == PH] == 0)
      real = (b["segment_ids"][r] > 0) & (b["targets"][r] != PH)
      assert np.all(b["weights"][r][real] == 1)
      pictures += len(used)
      for seg in np.unique(b["segment_ids"][r][b["segment_ids"][r] > 0]):
        text_pieces += not np.any(is_ph[b["segment_ids"][r] == seg])
      # Each picture's placeholders run right after its bos, then its caption follows.
      starts = np.flatnonzero(is_ph & ~np.roll(is_ph, 1))
      assert np.all(b["inputs"][r][starts - 1] == 256)
  assert pictures > 4 and text_pieces > 2                  # both sources in the mix


def test_packed_batch_embeds_each_picture_as_alone():
  c = mm_config()
  model = random_model(c.model)
  graphdef, state = nnx.split(model)
  batch = batches(c, 1)[0]
  media = steps.batch_media(batch)

  @jax.jit
  def embed(state, tokens, media):
    return nnx.merge(graphdef, state).embed_with_images(tokens, media)

  @jax.jit
  def alone(state, media):
    return nnx.merge(graphdef, state).embed_images(media)

  x = np.asarray(embed(state, batch["inputs"], media))
  table = np.asarray(model.embed[...])
  s = spec(c)
  checked = 0
  for r in range(BATCH):
    is_ph = batch["inputs"][r] == PH
    np.testing.assert_array_equal(x[r][~is_ph], table[batch["inputs"][r][~is_ph]])
    where, start = np.flatnonzero(is_ph), 0
    for k, grid in enumerate(batch["media_grid_thw"][r]):
      if grid[0] == 0:
        continue
      patches = batch["media_patches"][r][batch["media_segment_ids"][r] == k + 1]
      one, (n,) = pack([(patches, tuple(grid))], max_patches=s.max_patches,
                       max_media=s.max_media, merge=s.merge, temporal_pool=s.temporal_pool)
      want = np.asarray(alone(state, one))[:n]
      np.testing.assert_allclose(x[r][where[start:start + n]], want, rtol=1e-5, atol=1e-5)
      start, checked = start + n, checked + 1
    assert start == len(where)
  assert checked >= 2


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_state_restores_mid_stream(workers):
  c = mm_config()
  c.data.worker_count = workers
  ds = k3data.make_dataset(c.data, seq_len=SEQ, global_batch=BATCH, seed=0, media=spec(c))
  it = iter(ds)
  for _ in range(3):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(2)]
  json.loads(json.dumps(state))                            # what a checkpoint stores
  fresh = iter(ds)
  fresh.set_state(state)
  got = [next(fresh) for _ in range(2)]
  if workers:   # the same batches as reading in this process
    c.data.worker_count = 0
    inproc = batches(c, 5)[3:]
    for a, b in zip(want, inproc):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    it.close()
    fresh.close()
  for a, b in zip(got, want):
    assert set(a) == set(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_files_load_and_bad_files_say_what_is_wrong(tmp_path):
  rng = np.random.default_rng(0)
  np.save(tmp_path / "ok.npy", rng.integers(0, 256, (60, 70, 3), dtype=np.uint8))
  np.save(tmp_path / "clip.npy", rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8))
  np.save(tmp_path / "rgba.npy", np.zeros((56, 56, 4), np.uint8))
  np.save(tmp_path / "tiny.npy", np.zeros((20, 56, 3), np.uint8))
  np.save(tmp_path / "huge.npy", np.zeros((28 * 6, 28 * 6, 3), np.uint8))
  (tmp_path / "broken.npy").write_bytes(b"\x93NUMPY garbage")
  (tmp_path / "photo.png").write_bytes(b"not a png")
  names = ["ok.npy", "clip.npy", "rgba.npy", "tiny.npy", "huge.npy", "broken.npy", "photo.png"]
  with open(tmp_path / "m.jsonl", "w") as f:
    for n in names:
      f.write(json.dumps({"video" if n == "clip.npy" else "image": n, "text": "x " + n}) + "\n")
  c = mm_config()
  c.data.images.source, c.data.images.paths = "files", (str(tmp_path / "*.jsonl"),)
  c.data.heldout_every = 0
  k3config.validate(c)
  tok = k3data.make_tokenizer(c.data.tokenizer)
  ex = images.ImageTextExamples(c.data.images, spec(c), tok, seq_len=SEQ, seed=0,
                                split="train")
  first = ex[0]
  assert first["grid"].tolist() == [[1, 6, 6]] and first["patches"].shape == (36, 588)
  assert np.sum(first["inputs"] == PH) == 9
  assert tok.decode(first["targets"][9:-1]) == "x ok.npy"
  assert ex[1]["grid"].tolist() == [[4, 4, 4]] and np.sum(ex[1]["inputs"] == PH) == 4
  for i, match in [(2, r"rgba.npy: .*\[H, W, 3\]"), (3, "tiny.npy: .*too small"),
                   (4, "huge.npy: .*too large"), (5, "broken.npy: not a readable .npy"),
                   (6, "photo.png: not a readable image")]:
    with pytest.raises(ValueError, match=match):
      ex[i]
  (tmp_path / "bad.jsonl").write_text('{"image": "ok.npy"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1: need"):
    images.read_manifests(str(tmp_path / "bad.jsonl"), "train", 0)
  with pytest.raises(FileNotFoundError, match="no file matches"):
    images.read_manifests(str(tmp_path / "none*.jsonl"), "train", 0)


def test_image_files_decode_to_rgb(tmp_path):
  """PNG and JPEG files (Pillow, the `data` extra) load as uint8 [H, W, 3]: PNG exactly,
  JPEG within its lossy error; grayscale and RGBA are converted to RGB; a truncated PNG is
  refused naming the file."""
  from PIL import Image  # noqa: PLC0415
  rng = np.random.default_rng(1)
  rgb = rng.integers(0, 256, (57, 71, 3), dtype=np.uint8)
  smooth = np.broadcast_to(np.linspace(0, 255, 71, dtype=np.uint8)[None, :, None], (57, 71, 3))
  Image.fromarray(rgb).save(tmp_path / "a.png")
  Image.fromarray(np.ascontiguousarray(smooth)).save(tmp_path / "b.jpg", quality=95)
  Image.fromarray(rgb[..., 0]).save(tmp_path / "gray.png")
  Image.fromarray(np.concatenate([rgb, np.full((57, 71, 1), 7, np.uint8)], -1)).save(
      tmp_path / "rgba.png")
  np.testing.assert_array_equal(images.load_pixels(str(tmp_path / "a.png")), rgb)
  jpg = images.load_pixels(str(tmp_path / "b.jpg"))
  assert jpg.shape == (57, 71, 3) and jpg.dtype == np.uint8
  assert np.max(np.abs(jpg.astype(int) - smooth)) <= 8
  np.testing.assert_array_equal(images.load_pixels(str(tmp_path / "gray.png")),
                                np.repeat(rgb[..., :1], 3, -1))
  np.testing.assert_array_equal(images.load_pixels(str(tmp_path / "rgba.png")), rgb)
  (tmp_path / "cut.png").write_bytes((tmp_path / "a.png").read_bytes()[:200])
  with pytest.raises(ValueError, match="cut.png: not a readable image"):
    images.load_pixels(str(tmp_path / "cut.png"))


@pytest.mark.parametrize("field,value,match", [
    ("model.vision.enabled", False, "data.images.source.*model.vision.enabled"),
    ("data.packing", "concat_then_split", "data.packing.*first_fit"),
    ("data.images.weight", 0.0, "data.images.weight"),
    ("data.images.source", "pictures", "data.images.source"),
    ("data.images.paths", ("/x/*.jsonl",), "data.images.paths"),
])
def test_config_errors_name_the_field(field, value, match):
  c = mm_config()
  set_field(c, field, value)
  with pytest.raises(k3config.ConfigError, match=match):
    k3config.validate(c)


def test_text_only_source_none_needs_images():
  c = micro_config()
  c.data.source = "none"
  with pytest.raises(k3config.ConfigError, match="data.source"):
    k3config.validate(c)


def test_train_steps_with_the_tower_are_finite_and_reach_it():
  """Two train steps on pipeline batches with pictures, data-parallel over 2 devices (one
  MLA layer with the dense FFN and AdamW: the cheapest compile; no weight decay, so a
  parameter moves only where a gradient was non-zero): finite losses, and every tower
  array moves, so the caption loss reaches all of the tower through the placeholders."""
  c = mm_config()
  c.model.num_layers, c.model.dense_layers = 1, 1
  c.optimizer.name, c.optimizer.weight_decay = "adamw", 0.0
  c.mesh.data = 2            # rows, and so each row's media, split over 2 devices
  k3config.validate(c)
  prog = program.build(c, parallel.make_mesh(c.mesh, jax.devices()[:2]))
  _, params, rest = nnx.split(random_model(c.model), nnx.Param, ...)
  params, rest = nnx.as_pure(params), nnx.as_pure(rest)
  before = jax.tree.map(np.asarray, params["vision"])
  state = jax.device_put((params, rest, prog.tx.init(params)), prog.state_shardings)
  losses = []
  with prog.rules():
    for b in batches(c, 2):
      *state, out = prog.train_step(*state, jax.device_put(b, prog.batch_shardings))
      losses.append(float(out["loss"]))
      assert int(out["skipped"]) == 0
  assert np.all(np.isfinite(losses)), losses
  after = state[0]["vision"]
  for (path, x), y in zip(jax.tree.leaves_with_path(before), jax.tree.leaves(after)):
    assert np.abs(np.asarray(y) - x).max() > 0, jax.tree_util.keystr(path)

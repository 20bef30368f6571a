"""Decoding (k3jax.decode) against the training forward: teacher forcing gives the same
logits, token by token, for every layer kind together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config, random_model
from flax import nnx

from k3jax import decode
from k3jax.model import K3Model


def test_token_by_token_equals_the_forward():
  """micro_config's stack (a dense-FFN first cycle with KDA and MLA, two scanned cycles of
  KDA + MLA with LatentMoE and Quantile Balancing's bias, the final MLA, AttnRes blocks
  across them), fp32: 2 rows x 7 tokens stepped one at a time from an empty cache give
  the forward's logits at every position within 1e-4 relative. The forward runs KDA's
  token-by-token recurrence ("naive", what a step runs): the chunk form's fp32 rounding,
  amplified through 13 random layers, exceeds this tolerance."""
  c = micro_config()
  c.model.moe.dispatch = "dropless"     # per token: no capacity to differ between the two
  c.model.kda.backend = "naive"
  model = random_model(c.model, model_cls=K3Model)
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 7)), jnp.int32)
  want, _ = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, jnp.ones_like(t)))(state, tokens)

  @jax.jit
  def one(state, token, cache, pos):
    return decode.step(nnx.merge(graphdef, state), token, cache, pos)

  cache = decode.init_cache(model, 2, 8)
  got = []
  for t in range(7):
    logits, cache = one(state, tokens[:, t:t + 1], cache, jnp.full((2,), t, jnp.int32))
    got.append(np.asarray(logits[:, 0]))
  got, want = np.stack(got, 1), np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_generate_greedy_equals_argmax_of_the_forward():
  """Greedy generation from two prompts of unequal lengths (3 and 6 tokens) continues each
  with the argmax of the forward's logits over the sequence so far, token after token.
  (The forward always reads the longest sequence's positions, the sequence so far first:
  the model is causal (`test_causal`), so the padding after it changes none of its logits;
  one compile.)"""
  c = micro_config()
  c.model.moe.dispatch, c.model.kda.backend = "dropless", "naive"
  model = random_model(c.model, model_cls=K3Model)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, jnp.ones_like(t))[0])
  prompts = [[5, 9, 2], [7, 1, 30, 4, 4, 11]]
  got = decode.generate(model, prompts, max_new_tokens=4, eos_id=None, key=jax.random.key(0))
  width = max(map(len, prompts)) + 4
  for prompt, new in zip(prompts, got):
    seq = list(prompt)
    for _ in range(4):
      padded = jnp.asarray([seq + [0] * (width - len(seq))])
      seq.append(int(jnp.argmax(forward(state, padded)[0, len(seq) - 1])))
    assert new == seq[len(prompt):]


def test_sampling_rules():
  """Temperature 0 and top_k = 1 give the argmax; top_p below the largest probability keeps
  only it; top_k = 2 never draws outside the two largest; a seed repeats its draws."""
  logits = jnp.asarray([[0.0, 3.0, 1.0, 2.9], [5.0, -1.0, 4.0, 0.0]])
  key = jax.random.key(1)
  best = [1, 0]
  assert decode.sample(logits, key).tolist() == best
  assert decode.sample(logits, key, temperature=1.0, top_k=1).tolist() == best
  assert decode.sample(logits, key, temperature=1.0, top_p=0.3).tolist() == best
  keys = jax.random.split(key, 200)
  draws = np.stack([decode.sample(logits, k, temperature=2.0, top_k=2) for k in keys])
  assert set(draws[:, 0]) == {1, 3} and set(draws[:, 1]) == {0, 2}
  again = np.stack([decode.sample(logits, k, temperature=2.0, top_k=2) for k in keys])
  np.testing.assert_array_equal(draws, again)


def test_generate_stops_at_eos_and_refuses_empty_prompts():
  c = micro_config()
  c.model.moe.dispatch = "dropless"
  model = random_model(c.model, model_cls=K3Model)
  first = decode.generate(model, [[3, 4]], max_new_tokens=3, eos_id=None,
                          key=jax.random.key(0))[0]
  stopped = decode.generate(model, [[3, 4]], max_new_tokens=3, eos_id=first[0],
                            key=jax.random.key(0))[0]
  assert stopped == first[:1]
  with pytest.raises(ValueError, match="at least one token"):
    decode.generate(model, [[]], max_new_tokens=3, eos_id=None, key=jax.random.key(0))


def test_generate_command_continues_a_prompt_from_a_checkpoint(tmp_path):
  """`python -m k3jax.generate` reads k3_tiny's weights from a checkpoint directory and
  prints the prompt and its continuation; a directory without one is a clear error."""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  from k3jax.convert import importer  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "experiments"))
  import k3_tiny  # noqa: PLC0415
  from k3jax import parallel, program  # noqa: PLC0415
  cfg = k3_tiny.get_config()
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh))
  rng = np.random.default_rng(0)
  params, rest = jax.tree.map(
      lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype),
      prog.abstract_state[:2])
  importer.write_weights(str(tmp_path / "w"), params, rest, cfg.to_json())

  def generate(workdir, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "k3jax.generate", "--config=experiments/k3_tiny.py",
         f"--workdir={workdir}", "--prompt=The cat", "--max_new_tokens=6", "--temperature=0.7",
         "--top_k=20", *overrides], cwd=root, capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})

  got = generate(tmp_path / "w")
  assert got.returncode == 0, got.stderr[-3000:]
  assert got.stdout.startswith("The cat") and "# step 0 of" in got.stderr
  missing = generate(tmp_path / "none")
  assert missing.returncode != 0 and "--workdir: " in missing.stderr
  assert "does not exist" in missing.stderr
  other = generate(tmp_path / "w", "--config.model.kda.num_heads=2")
  assert other.returncode != 0 and "model.kda.num_heads" in other.stderr, other.stderr[-2000:]


def test_prompts_longer_than_the_cache_are_refused():
  c = micro_config()
  model = random_model(c.model, model_cls=K3Model)
  with pytest.raises(ValueError, match="prompts of 6 tokens do not fit a cache of 5"):
    decode.prefill(model, jnp.ones((1, 6), jnp.int32), 5)


def assert_prefill_then_steps_equal_the_forward(graphdef, state, tokens, *, prefilled: int,
                                                max_len: int, media=None):
  """tokens [B, T]: the first `prefilled` through `decode.prefill`, the rest stepped one at
  a time; all T positions' logits equal the forward's within 1e-4 (of the largest)."""
  want = np.asarray(jax.jit(lambda s, t, md: nnx.merge(graphdef, s)(t, jnp.ones_like(t), md)[0])(
      state, tokens, media))
  logits, cache = jax.jit(lambda s, t, md: decode.prefill(nnx.merge(graphdef, s), t, max_len,
                                                          md))(state, tokens[:, :prefilled], media)
  got = [np.asarray(logits)]
  one = jax.jit(lambda s, t, c, p: decode.step(nnx.merge(graphdef, s), t, c, p))
  for t in range(prefilled, tokens.shape[1]):
    logits, cache = one(state, tokens[:, t:t + 1], cache,
                        jnp.full((tokens.shape[0],), t, jnp.int32))
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=1e-4,
                             atol=1e-4 * np.abs(want).max())
  return cache


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_prefill_of_an_odd_length_then_steps_equals_the_forward(form):
  """The first 5 tokens through `prefill` (each layer's own forward, MLA in either form,
  returning KDA's final state and conv tail and MLA's latents), the last 4 stepped (MLA
  absorbed): the forward's logits at all 9 positions within 1e-4 (fp32)."""
  c = micro_config()
  c.model.moe.dispatch, c.model.kda.backend = "dropless", "naive"
  c.model.mla.form = form
  model = random_model(c.model, model_cls=K3Model)
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (2, 9)), jnp.int32)
  assert_prefill_then_steps_equal_the_forward(graphdef, state, tokens, prefilled=5, max_len=12)


def test_an_image_prompt_decodes_as_the_forward_sees_it():
  """micro_config with a small tower: a prompt holding an image's 4 placeholder tokens,
  prefilled with the image, then stepped: the logits of the forward given the same image
  within 1e-4; generate refuses placeholders it would only step through."""
  from k3jax.media import pack, patchify  # noqa: PLC0415
  c = micro_config()
  m = c.model
  m.moe.dispatch, m.kda.backend = "dropless", "naive"
  v = m.vision
  v.enabled, v.placeholder_id, v.attention = True, 63, "reference"
  v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim = 2, 16, 2, 8, 32
  v.patch_size, v.pos_grid, v.max_patches, v.max_media = 2, 4, 32, 2
  model = random_model(m, model_cls=K3Model)
  graphdef, state = nnx.split(model)
  image = np.random.default_rng(3).uniform(-1, 1, (8, 8, 3)).astype(np.float32)
  media, counts = pack([patchify(image, patch_size=2, merge=2)], max_patches=32, max_media=2,
                       merge=2, temporal_pool=v.temporal_pool)
  assert counts == [4]
  tokens = jnp.asarray([[5, 63, 63, 63, 63, 9, 12, 30, 2]], jnp.int32)
  assert_prefill_then_steps_equal_the_forward(graphdef, state, tokens, prefilled=6, max_len=10,
                                              media=media)
  with pytest.raises(ValueError, match="image placeholders past the first 2 tokens"):
    decode.generate(model, [[5, 9], [5, 63, 63, 63, 63]], max_new_tokens=1, eos_id=None,
                    key=jax.random.key(0), media=media)


def test_a_cache_sharded_on_a_mesh_decodes_as_the_forward():
  """8 devices as data 2 x context 2 x tensor 2, the parameters sharded by the mesh rules:
  a prefill of 8 tokens then 4 steps give the forward's logits (1e-4), and the cache is
  split like the activations: rows over data, KDA's heads over tensor, MLA's cached
  positions over context."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from k3jax import parallel  # noqa: PLC0415
  from k3jax.axes import use_rules  # noqa: PLC0415
  c = micro_config()
  c.model.moe.dispatch, c.model.kda.backend = "dropless", "naive"
  model = random_model(c.model, model_cls=K3Model)
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(4).integers(1, 64, (2, 12)), jnp.int32)
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 1, 1, 2, 2), parallel.MESH_AXES)
  with use_rules(mesh, parallel.RULES):
    state = jax.device_put(state, parallel.shardings(mesh, state))
    tokens = jax.device_put(tokens, NamedSharding(mesh, parallel.batch_spec()))
    cache = assert_prefill_then_steps_equal_the_forward(graphdef, state, tokens, prefilled=8,
                                                        max_len=12)
  kinds = {"latent": 0, "state": 0}
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    name, spec = path[-1].key, leaf.sharding.spec
    spec = (*spec, *[None] * (leaf.ndim - len(spec)))[-(leaf.ndim if path[0].key != "cycles"
                                                       else leaf.ndim - 1):]
    if name == "latent":
      assert "data" in str(spec[0]) and spec[1] == "context", (path, spec)
    elif name == "state":
      assert "data" in str(spec[0]) and spec[1] == "tensor", (path, spec)
    kinds[name] = kinds.get(name, 0) + 1
  assert kinds["latent"] and kinds["state"]

"""The whole K3 model: layer layout, packing, scan vs unrolled, remat, balancing, axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_eqns, micro_config, random_model
from flax import nnx

from k3jax import config as k3config
from k3jax.model import K3Model, layer_plan
from k3jax.model.quantile_balancing import BalanceBias
from k3jax.model.remat import SAVEABLE

# One pytest-xdist worker for the module (--dist loadgroup): its module-wide fixtures and
# cached reference runs compile once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_model")

AXES = {"batch", "seq", "embed", "vocab", "heads", "head_dim", "q_lora", "kv_lora", "mlp",
        "experts", "latent", "gate_rank", "conv", "layers", "sources"}


def forward(model, tokens, segment_ids):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t, g: nnx.merge(graphdef, s)(t, g))(state, tokens, segment_ids)


def test_full_layer_plan():
  plan = layer_plan(k3config.base_config().model)
  mla = [i + 1 for i, m in enumerate(plan.mixers) if m == "mla"]
  assert mla == list(range(4, 93, 4)) + [93]  # 24 MLA layers, the last one global
  assert plan.mixers.count("kda") == 69
  assert plan.ffns[0] == "dense" and set(plan.ffns[1:]) == {"moe"}
  assert (plan.prefix, plan.num_cycles, plan.cycle, plan.suffix) == (4, 22, 4, 1)


@pytest.fixture(scope="module")
def micro():
  cfg = micro_config()
  cfg.model.moe.dispatch = "dropless"  # capacity drops would couple the documents
  return cfg, random_model(cfg.model)


def test_document_alone_equals_packed(micro):
  """A document's logits do not depend on what else is packed in the row (KDA state and
  conv, MLA mask, MoE routing all respect segment ids).

  The document starts at a chunk boundary (after 32 tokens), so the chunked KDA computes
  it as when it stands alone and the logits agree to fp32 rounding. From inside a chunk
  (e.g. after 19 tokens) the chunked form rounds differently (~1.5e-6 at the KDA op; its
  packed documents against the naive recurrence: test_kda_ops.test_packed_documents),
  which this random 13-layer model amplifies to ~4e-4 in the logits."""
  cfg, model = micro
  rng = np.random.default_rng(1)
  doc = rng.integers(0, 64, 21)
  other = rng.integers(0, 64, 32)
  alone = np.zeros((1, 53), np.int32)
  alone[0, :21] = doc
  packed = np.concatenate([other, doc])[None].astype(np.int32)
  seg_alone = np.array([[1] * 21 + [0] * 32], np.int32)
  seg_packed = np.array([[1] * 32 + [2] * 21], np.int32)
  la, _ = forward(model, alone, seg_alone)
  lp, _ = forward(model, packed, seg_packed)
  np.testing.assert_allclose(lp[0, 32:], la[0, :21], rtol=1e-6, atol=1e-6)
  # and a leak would show: the same document continuing the other one differs by far more
  seg_joined = np.ones((1, 53), np.int32)
  lj, _ = forward(model, packed, seg_joined)
  assert np.abs(np.asarray(lj[0, 32:]) - np.asarray(la[0, :21])).max() > 1e-2


def _scan_config(**changes):
  """micro_config without the dense prefix: 9 layers = two scanned [KDA x3, MLA] cycles and
  the final MLA (AttnRes block boundaries after layers 3 and 6: at different places in the
  two cycles). The scan is what differs; the 4 prefix layers would only add compile time."""
  c = micro_config()
  c.model.num_layers, c.model.dense_layers = 9, 0
  c.model.moe.dispatch = "dropless"
  # Every expert selected: no top-k decision that a rounding difference could flip.
  c.model.moe.balancing, c.model.moe.top_k = "none", c.model.moe.num_experts
  c.model.update_from_flattened_dict(changes)
  return c


# builds its own models (no `micro`): a group of its own, free to run beside this module's
@pytest.mark.xdist_group("scan_remat")
def test_scan_equals_unrolled_and_remat_keeps_gradients():
  """Scanned vs unrolled cycles, and every remat policy and scope, give the same loss and
  gradients."""
  tokens = np.random.default_rng(2).integers(0, 64, (2, 40)).astype(np.int32)
  seg = np.ones((2, 40), np.int32)
  # 5 layers, the fewest that scan two cycles (eleven gradients compile here): two
  # [KDA, MLA] cycles and the final MLA; the AttnRes boundary after layer 3 falls inside
  # the second cycle, none inside the first.
  small = {"num_layers": 5, "mla_every": 2}
  cfg = _scan_config(**small)
  graphdef, params, rest = nnx.split(random_model(cfg.model), nnx.Param, ...)
  plan = layer_plan(cfg.model)
  assert (plan.prefix, plan.num_cycles, plan.cycle, plan.suffix) == (0, 2, 2, 1)
  # A well-conditioned point: matrices at a quarter of random_model's scale (as in
  # tests/test_parallel.py; the AttnRes queries stay non-zero), so that fp32 rounding
  # differences are not amplified layer by layer into the size of what is measured.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (0.25 * x if x.ndim >= 2 and "embed" not in jax.tree_util.keystr(path)
                       else x), params)

  def loss_for(**changes):
    gd = nnx.graphdef(nnx.eval_shape(lambda: K3Model(_scan_config(**small, **changes).model,
                                                     rngs=nnx.Rngs(0))))

    def loss(p):
      logits, _ = nnx.merge(gd, p, rest)(tokens, seg)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.jit(jax.value_and_grad(loss))(params)

  base_loss, base_grad = loss_for()
  # The unrolled stack reads only the AttnRes sources that exist (`attn_res.Slots`), the
  # scanned one its whole buffer with the rest masked: sums over fewer terms, a few 1e-6
  # relative per gradient leaf (without AttnRes the two are bit-exact), below 1e-5. Remat
  # recomputes the forward in a differently fused program: fp32 rounding differences only,
  # about 1e-5 relative per gradient leaf, below 1e-4 (a wrong recomputation is O(1)).
  # remat_scope "layer": each scanned layer its own remat region inside the cycle's.
  # (attn_res.scan_saves "partial" without remat runs the same custom VJP as with it)
  for changes, tol in (({"scan_layers": False}, 1e-5), ({"remat": "full"}, 1e-4),
                       ({"remat": "dots"}, 1e-4), ({"remat": "kernels"}, 1e-4),
                       ({"remat": "elementwise"}, 1e-4),
                       ({"remat": "full", "remat_scope": "layer"}, 1e-4),
                       ({"remat": "full", "remat_save": ",".join(SAVEABLE)}, 1e-4),
                       ({"scan_layers": False, "remat": "kernels",   # k3_small's
                         "remat_save": ",".join(SAVEABLE)}, 1e-4),
                       ({"remat": "full", "remat_scope": "layer", "remat_save": "kda_proj"},
                        1e-4),
                       ({"attn_res.scan_saves": "partial", "remat": "full"}, 1e-4)):
    value, g = loss_for(**changes)
    np.testing.assert_allclose(value, base_loss, rtol=1e-5, err_msg=str(changes))
    for (path, a), (_, b) in zip(nnx.to_flat_state(g), nnx.to_flat_state(base_grad)):
      err = np.linalg.norm(a[...] - b[...]) / max(np.linalg.norm(b[...]), 1e-12)
      assert err <= tol, (changes, path, err)


def _remat_grads(loss):
  """loss's gradient under remat "none", "full" and "kernels": {policy: function}."""
  from k3jax.model import remat  # noqa: PLC0415
  return {name: jax.grad(remat.wrap(loss, name)) for name in ("none", "full", "kernels")}


def _jaxpr_counts(grads, x, marker):
  """{policy: how often marker appears in its gradient's jaxpr at x}."""
  return {name: str(jax.make_jaxpr(f)(x)).count(marker) for name, f in grads.items()}


def test_kernels_remat_saves_the_kernels_outputs():
  """remat "kernels": the gradient of a rematerialized KDA (its Pallas kernels interpreted)
  launches the kernels of no remat, not the forward's again as "full" does; same values."""
  from pallas_kernels import kda as kda_ops  # noqa: PLC0415
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(3))
  g = -jnp.abs(jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32))
  beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((1, 32, 2)), jnp.float32))

  def loss(q):
    return jnp.sum(kda_ops.kda(2 * q, k, v, g, beta, backend="interpret", chunk_size=16) ** 2)

  grads = _remat_grads(loss)
  kernels = _jaxpr_counts(grads, q, "pallas_call")
  assert kernels["kernels"] == kernels["none"] < kernels["full"], kernels
  np.testing.assert_allclose(grads["kernels"](q), grads["none"](q), rtol=1e-6)


def test_kernels_remat_saves_flash_attention_computed_inside_a_custom_vjp():
  """remat "kernels" on JAX's Triton `mha` (interpreted), whose forward rule computes its
  residuals through a nested custom VJP: the forward kernel runs once, as without remat
  ("full" runs it twice); same gradient."""
  from pallas_kernels.attention.flash import flash_gpu  # noqa: PLC0415
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32)
  ids = jnp.ones((1, 32), jnp.int32)

  def loss(q):
    return jnp.sum(flash_gpu(q, k, v, ids, scale=0.25, causal=True, interpret=True) ** 2)

  grads = _remat_grads(loss)
  forwards = _jaxpr_counts(grads, q, "name=mha_forward")
  assert forwards == {"none": 1, "full": 2, "kernels": 1}, forwards
  np.testing.assert_allclose(grads["kernels"](q), grads["none"](q), rtol=1e-6)


def test_kernels_remat_saves_cudnn_flash_attention(monkeypatch):
  """remat "kernels" on MLA's GPU attention (`flash_cuda`: cuDNN unpacked, cuDNN packed or
  Triton, switched per batch): no branch's forward kernel runs again in the recompute, as
  without remat ("full" runs each twice). Counted in the gradient's jaxpr; cuDNN's version
  and GPU checks are bypassed, since tracing needs neither."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  import pallas_kernels.attention as attention  # noqa: PLC0415
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda *a, **k: None)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a, **k: True)
  monkeypatch.setattr(attention, "cudnn_ready", lambda: True)
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  ids = jnp.ones((1, 64), jnp.int32)

  def loss(q):
    out = attention.flash_cuda(q, q, q, ids, scale=0.125, causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grads = _remat_grads(loss)
  cudnn_forwards = _jaxpr_counts(grads, q, "dot_product_attention_fwd_wrapper")
  triton_forwards = _jaxpr_counts(grads, q, "name=mha_forward")
  assert cudnn_forwards == {"none": 2, "full": 4, "kernels": 2}, cudnn_forwards
  assert triton_forwards == {"none": 1, "full": 2, "kernels": 1}, triton_forwards


@pytest.mark.parametrize("save,fewer", [
    ("kda_proj", {"matmuls": 4 * 3}), ("glu_proj", {"matmuls": 2 * 2 * 5}),
    ("moe_latent", {"matmuls": 5}), ("mla_proj", {"matmuls": 3 * 2}),
    ("moe_experts", {"matmuls": 3 * 5, "sorts": 5}),
    ("layer_out", {"matmuls": 4 + 1 + 3 * 3})])
def test_remat_save_keeps_the_named_values_out_of_the_recompute(save, fewer):
  """remat "full" with `remat_save`: the gradient recomputes the forward without what makes
  the named values. Counted in the gradient's jaxpr of `_scan_config`, where the scanned
  cycle's body and the final layer appear once: 3 KDA layers (q, k, v and the output gate's
  projections), 5 MoE layers (two shared experts' GLU inputs each; the latent; the routed
  experts' three grouped matmuls and the dispatch's sort), 2 MLA layers (q, kv and the
  output gate). layer_out: the cycle's 4 mixers' and the final layer's output projections,
  and 3 of the cycle's 4 MoE outputs (W_up and the two shared experts' W_d each); the last
  FFN of a region is never recomputed, since no later layer inside it reads it."""
  tokens = np.zeros((2, 40), np.int32)
  seg = np.ones((2, 40), np.int32)

  def counts(**changes):
    cfg = _scan_config(remat="full", **changes)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0))))

    def loss(state):
      return jnp.sum(nnx.merge(graphdef, state)(tokens, seg)[0].astype(jnp.float32))
    names = [e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)]
    return {"matmuls": sum(n in ("dot_general", "ragged_dot_general") for n in names),
            "sorts": names.count("sort")}

  full, kept = counts(), counts(remat_save=save)
  assert {key: full[key] - kept[key] for key in full} == {"sorts": 0, **fewer}


def test_elementwise_remat_keeps_less_for_the_backward_than_none():
  """remat "elementwise": no region, but the GLU activations keep only their inputs for the
  backward (`remat.recomputed`): fewer and smaller residuals than "none" (the gradients
  are equal: `test_scan_equals_unrolled_and_remat_keeps_gradients`)."""
  tokens, seg = np.zeros((2, 40), np.int32), np.ones((2, 40), np.int32)

  def residuals(remat):
    cfg = _scan_config(remat=remat, scan_layers=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0))))

    def loss(state):
      return jnp.sum(nnx.merge(graphdef, state)(tokens, seg)[0].astype(jnp.float32))
    kept = jax.eval_shape(lambda s: jax.tree.leaves(jax.vjp(loss, s)[1]), state)
    return len(kept), sum(x.size * x.dtype.itemsize for x in kept)

  (n_none, bytes_none), (n_elem, bytes_elem) = residuals("none"), residuals("elementwise")
  assert n_elem < n_none and bytes_elem < bytes_none, (n_none, bytes_none, n_elem, bytes_elem)


def test_equal_configs_build_equal_graphdefs():
  """The remat policy is derived when traced, not held: two models of one config with
  `remat_save` have equal graphdefs (what jit and nnx caches compare)."""
  cfg = _scan_config(remat="full", remat_scope="layer", remat_save="kda_proj,moe_experts")
  graphdef = lambda: nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg.model,  # noqa: E731
                                                                 rngs=nnx.Rngs(0))))
  assert graphdef() == graphdef()


def test_remat_save_names_are_checked():
  cfg = micro_config()
  cfg.model.remat_save = "kda_proj,kda_projections"
  with pytest.raises(k3config.ConfigError, match="model.remat_save.*kda_projections"):
    k3config.validate(cfg)


def test_layer_remat_scope_puts_each_scanned_layer_in_its_own_region():
  """remat_scope "layer": inside the scanned cycle's remat region, each of its 4 layers is
  one more (nested) region; "cycle": the cycle is one region. Counted in the traced forward
  (the unscanned final layer is one region under both)."""
  tokens = np.zeros((2, 40), np.int32)
  seg = np.ones((2, 40), np.int32)

  def regions(scope):
    cfg = _scan_config(remat="full", remat_scope=scope)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0))))

    def loss(state):
      logits, _ = nnx.merge(graphdef, state)(tokens, seg)
      return jnp.sum(logits)
    return str(jax.make_jaxpr(loss)(state)).count("remat2[")  # jax.checkpoint's primitive

  assert regions("cycle") == 2
  assert regions("layer") == 2 + 4


def test_plain_residual_switch():
  cfg = micro_config()
  cfg.model.attn_res.enabled = False
  model = random_model(cfg.model)
  assert not any("query" in str(p) for p, _ in nnx.to_flat_state(nnx.state(model)))
  logits, _ = forward(model, np.ones((1, 16), np.int32), np.ones((1, 16), np.int32))
  assert np.all(np.isfinite(logits))


def test_balance_update_reaches_every_moe_layer(micro):
  cfg, model = micro
  model = nnx.clone(model)
  tokens = np.random.default_rng(3).integers(0, 64, (2, 40)).astype(np.int32)
  _, aux = forward(model, tokens, np.ones((2, 40), np.int32))
  before = [np.asarray(b) for _, b in nnx.to_flat_state(nnx.state(model, BalanceBias))]
  stats = model.update_balance(aux)
  after = [np.asarray(b) for _, b in nnx.to_flat_state(nnx.state(model, BalanceBias))]
  assert len(after) == 8  # prefix layers 2-4, one stacked leaf per cycle position, suffix
  assert sum(a.size // 8 for a in after) == 12  # the 12 MoE layers of 13
  for b, a in zip(before, after):
    assert not np.allclose(a, b)
    np.testing.assert_allclose(a.mean(-1), 0, atol=1e-5)  # mean-centred per layer
  assert float(stats["moe_max_load"]) >= 1.0


def test_every_parameter_has_logical_axes():
  abstract = nnx.eval_shape(lambda: K3Model(micro_config().model, rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(abstract)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == len(var.shape), (path, names)
    assert set(names) <= AXES, (path, names)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_causal(dispatch):
  """Changing token t changes no logit before t, in any row of the batch."""
  cfg = micro_config()
  cfg.model.moe.dispatch = dispatch
  model = random_model(cfg.model)
  rng = np.random.default_rng(4)
  tokens = rng.integers(0, 64, (2, 40)).astype(np.int32)
  seg = np.ones((2, 40), np.int32)
  changed = tokens.copy()
  changed[0, 25] = (changed[0, 25] + 7) % 64
  a, _ = forward(model, tokens, seg)
  b, _ = forward(model, changed, seg)
  diff = np.abs(np.asarray(a) - np.asarray(b)).max(-1)
  assert diff[0, :25].max() == 0 and diff[1].max() == 0
  assert diff[0, 25:].max() > 0


def test_bf16_compute_reaches_the_kda_recurrence(monkeypatch):
  """With bf16 compute and fp32 parameters, the KDA layer hands its recurrence q, k, v in
  bf16 (the short conv's fp32 taps once promoted them, and the H200 kernel then ran its
  matmuls in fp32, 16x slower); the gate and beta stay fp32 by design."""
  from k3jax.model import kda as kda_layer  # noqa: PLC0415
  seen = []
  real = kda_layer.kda_ops.kda

  def spy(q, k, v, g, beta, **kw):
    seen.append(tuple(x.dtype for x in (q, k, v, g, beta)))
    return real(q, k, v, g, beta, **kw)

  monkeypatch.setattr(kda_layer.kda_ops, "kda", spy)
  cfg = micro_config().model
  cfg.dtype, cfg.param_dtype = "bfloat16", "float32"
  layer = kda_layer.KDA(cfg, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 16, cfg.d_model), jnp.bfloat16)
  y, _ = jax.eval_shape(layer, x, jnp.ones((1, 16), jnp.int32))
  assert seen == [(jnp.bfloat16,) * 3 + (jnp.float32,) * 2]
  assert y.dtype == jnp.bfloat16


def test_softplus_gate_layer_chunked_and_kernel_equal_the_recurrence():
  """A KDA layer with Kimi Linear's softplus gate: "auto" (the chunked form on CPU) and the
  kernels (interpret mode), each told the gate is unbounded, give the literal recurrence's
  output, packed documents included."""
  from k3jax.model import kda as kda_layer  # noqa: PLC0415
  cfg = micro_config().model
  cfg.kda.gate = "softplus"
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 40, cfg.d_model)), jnp.float32)
  seg = jnp.asarray(np.repeat([[1, 2], [3, 3]], [17, 23], axis=1), jnp.int32)
  outs = {}
  for backend in ("auto", "interpret", "naive"):
    cfg.kda.backend = backend
    outs[backend] = kda_layer.KDA(cfg, rngs=nnx.Rngs(0))(x, seg)[0]
  np.testing.assert_allclose(outs["auto"], outs["naive"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(outs["interpret"], outs["naive"], rtol=1e-4, atol=1e-5)


def test_bf16_gradients_sum_in_fp32():
  """With bf16 compute, no sum in the model's gradient runs in bf16: a parameter's gradient
  summed over positions (the short conv's taps) or an activation's over heads (MLA's shared
  rope key) loses a percent or more so (test_short_conv.py's
  test_tap_gradients_sum_in_fp32). Sums over an axis of length 1 change nothing and are
  allowed."""
  cfg = micro_config().model
  cfg.dtype = "bfloat16"
  graph, params, rest = nnx.split(K3Model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tokens, seg = jnp.zeros((2, 32), jnp.int32), jnp.ones((2, 32), jnp.int32)

  def loss(p):
    logits, _ = nnx.merge(graph, p, rest)(tokens, seg)
    return jnp.sum(logits.astype(jnp.float32))

  bf16_sums = [(e.invars[0].aval.shape, e.params["axes"])
               for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
               if e.primitive.name == "reduce_sum" and e.invars[0].aval.dtype == jnp.bfloat16
               and np.prod([e.invars[0].aval.shape[a] for a in e.params["axes"]]) > 1]
  assert bf16_sums == []


def test_bf16_model_runs_fp32_matmuls_only_where_meant():
  """With bf16 compute, a float32 matmul operand appears only in the parts that are fp32 by
  design: the pure-JAX KDA chunk form (it upcasts), AttnRes's depth softmax, the router and
  the MoE combine. Anything else means a parameter or an upcast leaked into the compute
  dtype (as the short conv once did)."""
  cfg = micro_config().model
  cfg.dtype = "bfloat16"
  model = K3Model(cfg, rngs=nnx.Rngs(0))
  tokens, seg = jnp.zeros((2, 32), jnp.int32), jnp.ones((2, 32), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda t, s: model(t, s))(tokens, seg).jaxpr
  where = set()
  for e in jaxpr_eqns(jaxpr):
    if e.primitive.name == "dot_general" and any(v.aval.dtype == jnp.float32 for v in e.invars):
      frames = [f.file_name for f in e.source_info.traceback.frames
                if ("k3jax/" in f.file_name or "pallas_kernels/" in f.file_name)
                and not f.file_name.endswith("layers.py")]  # Dense: who called it
      where.add("/".join(frames[0].rsplit("/", 2)[-2:]))
  assert where and where <= {"kda/chunk.py", "attn_res/reference.py", "model/latent_moe.py",
                             "model/moe_dispatch.py"}

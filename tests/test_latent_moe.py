"""Stable LatentMoE (K3_SPEC 4) against a per-token loop, its gradients, masks and bias glue."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.axes import use_rules
from k3jax.config import base_config
from k3jax.model import quantile_balancing as qb
from k3jax.model.latent_moe import LatentMoE, update_bias

D, E, K, LAT, HID, SHARED, BINS = 24, 8, 3, 12, 16, 20, 64


def tiny_model_cfg(**moe):
  m = base_config().model
  m.d_model, m.dtype, m.param_dtype = D, "float32", "float32"
  e = m.moe
  e.num_experts, e.top_k, e.expert_dim, e.latent_dim = E, K, HID, LAT
  e.num_shared, e.shared_dim, e.routed_scaling, e.balance_bins = 2, SHARED, 1.5, BINS
  for name, value in moe.items():
    setattr(e, name, value)
  return m


def build(cfg, seed=0, bias_std=0.3):
  """LatentMoE with random values: shapes from eval_shape, values from numpy.

  (Eager init compiles a truncated normal per new shape, ~2 s each on CPU.) Matrices get
  N(0, 1/fan_in), vectors (norm gain) 1 + N(0, 0.1^2), the bias N(0, bias_std^2).
  """
  graphdef, state = nnx.split(nnx.eval_shape(lambda: LatentMoE(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def fill(path, v):
    shape, dtype = v.shape, v.dtype
    if path[-1] == "bias":
      x = rng.normal(size=shape) * bias_std
    elif len(shape) == 1:
      x = 1.0 + 0.1 * rng.normal(size=shape)
    else:
      x = rng.normal(size=shape) / np.sqrt(shape[-2])
    return jnp.asarray(x, dtype)

  state = nnx.map_state(fill, state)
  return nnx.merge(graphdef, state)


def make(seed=0, bias_std=0.3, **moe):
  cfg = tiny_model_cfg(**moe)
  return cfg, build(cfg, seed, bias_std)


@nnx.jit
def forward(module, x, valid):
  return module(x, valid)


def inputs(b=2, t=8, seed=1):
  return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)


def np_(v):
  return np.asarray(v[...], np.float64)


def situ(g, v, b1=4.0, b2=25.0):
  return b1 * np.tanh(g / b1) * np.exp(-np.logaddexp(0.0, -g)) * b2 * np.tanh(v / b2)


def reference(module, cfg, x):
  """Per-token loop in float64: own top-k selection on s + b, experts one by one."""
  xs = np.asarray(x, np.float64).reshape(-1, D)
  wr, b = np_(module.router.kernel), np_(module.bias)
  wg, wu, wd = np_(module.w_g), np_(module.w_u), np_(module.w_d)
  w_down, w_up, gain = np_(module.w_down.kernel), np_(module.w_up.kernel), np_(
      module.latent_norm.weight)
  ys, sels = [], []
  for xt in xs:
    s = 1.0 / (1.0 + np.exp(-(xt @ wr)))
    sel = np.argsort(-(s + b))[:K]
    p = s[sel] / s[sel].sum()
    z = xt @ w_down
    u = sum(p[i] * cfg.moe.routed_scaling * (situ(z @ wg[j], z @ wu[j]) @ wd[j])
            for i, j in enumerate(sel))
    y = (u / np.sqrt(np.mean(u * u) + cfg.norm_eps) * gain) @ w_up
    for mlp in module.shared:
      y = y + situ(xt @ np_(mlp.w_g.kernel), xt @ np_(mlp.w_u.kernel)) @ np_(mlp.w_d.kernel)
    ys.append(y)
    sels.append(sel)
  return np.stack(ys).reshape(x.shape), np.stack(sels)


def test_matches_per_token_loop():
  cfg, module = make()
  x = inputs()
  y, aux = forward(module, x, None)
  assert y.shape == x.shape and y.dtype == jnp.float32
  ref, sels = reference(module, cfg, x)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
  load = np.bincount(sels.reshape(-1), minlength=E)
  np.testing.assert_array_equal(np.asarray(aux["load"]), load)
  assert aux["counts"].shape == (E, BINS) and aux["counts"].dtype == jnp.int32
  assert aux["load"].dtype == jnp.int32
  # the bias really selects: a large bias on expert 0 puts every token there
  module.bias[...] = np.eye(E, dtype=np.float32)[0] * 5.0
  y0, aux0 = forward(module, x, None)
  assert np.asarray(aux0["load"])[0] == x.shape[0] * x.shape[1]
  np.testing.assert_allclose(np.asarray(y0), reference(module, cfg, x)[0], rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_parameter_and_not_the_bias():
  _, module = make()
  x = inputs()
  cot = jax.random.normal(jax.random.key(2), x.shape)

  def loss(m):
    return jnp.sum(m(x, None)[0] * cot)

  grads = nnx.jit(nnx.grad(loss))(module)
  flat = nnx.to_flat_state(grads)
  names = {"/".join(map(str, path)) for path, _ in flat}
  assert "router/kernel" in names and "bias" not in " ".join(names)
  for path, g in flat:
    assert np.abs(np.asarray(g[...])).max() > 0, path
  # each routed expert that received tokens gets gradient in all three matrices
  load = np.asarray(forward(module, x, None)[1]["load"])
  for w in (grads.w_g, grads.w_u, grads.w_d):
    per_expert = np.abs(np.asarray(w[...])).reshape(E, -1).max(-1)
    np.testing.assert_array_equal(per_expert > 0, load > 0)
  # the bias only selects: its gradient is exactly zero
  bias_grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, qb.BalanceBias)))(module)
  assert np.abs(np.asarray(bias_grad.bias[...])).max() == 0.0


def test_valid_mask_only_affects_statistics():
  _, module = make()
  x = inputs()
  valid = np.arange(16).reshape(2, 8) % 8 < 5  # the last 3 positions of each row: padding
  y_all, aux_all = forward(module, x, np.ones((2, 8), bool))
  y, aux = forward(module, x, valid)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_all))
  n_valid = int(valid.sum())
  assert np.asarray(aux["counts"]).sum() == n_valid * E
  assert np.asarray(aux["load"]).sum() == n_valid * K
  assert np.asarray(aux_all["counts"]).sum() == 16 * E
  # the histogram equals the one of the valid tokens alone
  _, aux_sub = forward(module, x[:, :5], np.ones((2, 5), bool))
  np.testing.assert_array_equal(np.asarray(aux["counts"]), np.asarray(aux_sub["counts"]))


def test_shared_experts_added_unweighted():
  _, module = make()
  x = inputs()
  module.w_up.kernel[...] = np.zeros(module.w_up.kernel.shape, np.float32)
  y, _ = forward(module, x, None)
  shared = nnx.jit(lambda m, x: sum(mlp(x) for mlp in m.shared))(module, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(shared), rtol=1e-6, atol=1e-6)


def test_no_balancing_ignores_bias():
  _, module = make(balancing="none", bias_std=3.0)
  x = inputs()
  y, aux = forward(module, x, None)
  assert np.abs(np.asarray(aux["counts"])).sum() == 0
  module.bias[...] = np.zeros(E, np.float32)
  y0, _ = forward(module, x, None)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
  old = np.asarray(module.bias[...])
  update_bias(module, np.ones((E, BINS), np.int32))
  np.testing.assert_array_equal(np.asarray(module.bias[...]), old)


def test_update_bias_single_and_stacked():
  _, module = make()
  _, aux = forward(module, inputs(), None)
  old = module.bias[...]
  solve = jax.jit(qb.solve_bias, static_argnums=2)
  nnx.jit(update_bias)(module, aux["counts"])  # in place, under jit
  np.testing.assert_allclose(np.asarray(module.bias[...]),
                             np.asarray(solve(aux["counts"], old, K)), atol=1e-7)
  assert abs(float(np.mean(np.asarray(module.bias[...])))) < 1e-6
  # scanned layers hold a stacked bias [layers, E]: solved per layer with vmap
  old, counts = np.asarray(old), np.asarray(aux["counts"])
  stacked = qb.BalanceBias(np.stack([old, old * 2]))
  counts = np.stack([counts, counts[::-1]])
  nnx.jit(update_bias, static_argnames="k")(stacked, counts, k=K)
  for i in range(2):
    np.testing.assert_allclose(np.asarray(stacked[...][i]),
                               np.asarray(solve(counts[i], old * (i + 1), K)), atol=1e-7)


def test_axes_dtypes_and_mesh_constraints():
  cfg = tiny_model_cfg()
  cfg.dtype, cfg.param_dtype = "bfloat16", "bfloat16"
  module = build(cfg)
  names = {"/".join(map(str, p)): v.get_metadata()["out_sharding"]
           for p, v in nnx.to_flat_state(nnx.state(module))}
  assert names["router/kernel"] == ("embed", "experts")
  assert names["bias"] == ("experts",)
  assert names["w_down/kernel"] == ("embed", "latent")
  assert names["w_g"] == names["w_u"] == ("experts", "latent", "mlp")
  assert names["w_d"] == ("experts", "mlp", "latent")
  assert names["latent_norm/weight"] == ("latent",)
  assert names["w_up/kernel"] == ("latent", "embed")
  assert names["shared/0/w_g/kernel"] == ("embed", "mlp")
  assert module.router.kernel[...].dtype == jnp.float32  # the router stays fp32
  assert module.bias[...].dtype == jnp.float32
  assert module.w_g[...].dtype == jnp.bfloat16
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with use_rules(mesh, [("batch", "data"), ("experts", None)]):
    y, aux = forward(module, inputs(), None)
  assert y.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(y, np.float32)))
  assert np.asarray(aux["counts"]).sum() == 16 * E


def test_capacity_dispatch_equals_dropless_when_nothing_drops():
  x = inputs()
  _, dropless = make(dispatch="dropless")
  _, roomy = make(dispatch="capacity", capacity_factor=E / K)  # room for every pair
  y, aux = forward(dropless, x, None)
  y_cap, aux_cap = forward(roomy, x, None)
  np.testing.assert_allclose(np.asarray(y_cap), np.asarray(y), rtol=1e-5, atol=1e-5)
  assert int(aux_cap["dropped"]) == 0 and int(aux["dropped"]) == 0


def test_capacity_drops_latest_positions_first_and_counts_them():
  """With one slot per expert per row, an expert keeps its earliest token of each row;
  dropped pairs contribute nothing and are counted. Rows never affect each other."""
  cfg, module = make(dispatch="capacity", capacity_factor=E / (K * 8))  # capacity 1 per row
  module.bias[...] = np.zeros(E, np.float32)
  x = inputs(b=2, t=8)
  y, aux = forward(module, x, None)
  ref, sels = reference(module, cfg, x)
  assert int(aux["dropped"]) == sels.size - len({(i // 8, e) for i, s in
                                                 enumerate(sels.reshape(16, K)) for e in s})
  # Row 1 alone gives the same output as row 1 batched with row 0.
  y1, _ = forward(module, x[1:], None)
  np.testing.assert_allclose(np.asarray(y[1:]), np.asarray(y1), rtol=1e-5, atol=1e-5)
  # The first token of each row is never dropped: equals the dropless reference there.
  np.testing.assert_allclose(np.asarray(y[:, 0]), ref[:, 0], rtol=1e-5, atol=1e-5)


def scatter_form_capacity_moe(z, idx, weights, experts, num_experts, num_rows, capacity):
  """The capacity dispatch written with scatter / gather and differentiated by JAX."""
  n, k = idx.shape
  row = jnp.arange(n * k) // (n // num_rows * k)
  group = row * num_experts + idx.reshape(-1)
  order = jnp.argsort(group, stable=True)
  sizes = jnp.bincount(group, length=num_rows * num_experts)
  rank = jnp.zeros_like(group).at[order].set(
      jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[group[order]])
  slots = num_rows * num_experts * capacity
  slot = jnp.where(rank < capacity, group * capacity + rank, slots)
  buf = jnp.zeros((slots, z.shape[-1]), z.dtype).at[slot].set(jnp.repeat(z, k, 0), mode="drop")
  buf = buf.reshape(num_rows, num_experts, capacity, -1).swapaxes(0, 1)
  out = experts(buf).swapaxes(0, 1).reshape(slots, -1)
  pairs = out.at[slot].get(mode="fill", fill_value=0).reshape(n, k, -1)
  return jnp.einsum("nk,nkl->nl", weights, pairs)


def test_capacity_dispatch_gradients_equal_autodiff_of_the_scatter_form():
  """The gather-only dispatch (custom VJPs) against JAX's autodiff of the scatter form, with
  pairs dropped (capacity 2 of 12 pairs per expert and row): u and the gradients of z, the
  routing weights and an expert matrix."""
  from k3jax.model.moe_dispatch import capacity_moe  # noqa: PLC0415
  rows, t, lat, k, e = 2, 16, 6, 3, 4
  rng = np.random.default_rng(3)
  z = jnp.asarray(rng.normal(size=(rows * t, lat)), jnp.float32)
  idx = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(rows * t)]), jnp.int32)
  w = jnp.asarray(rng.uniform(size=(rows * t, k)), jnp.float32)
  mat = jnp.asarray(rng.normal(size=(e, lat, lat)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(rows * t, lat)), jnp.float32)

  def loss(dispatch, z, w, mat):
    experts = lambda buf: jnp.tanh(jnp.einsum("erck,ekl->ercl", buf, mat))
    u = dispatch(z, idx, w, experts, e, rows, 2)
    return jnp.sum((u[0] if isinstance(u, tuple) else u) * cot)

  ours = jax.jit(jax.value_and_grad(lambda *a: loss(capacity_moe, *a), (0, 1, 2)))(z, w, mat)
  ref = jax.jit(jax.value_and_grad(lambda *a: loss(scatter_form_capacity_moe, *a),
                                   (0, 1, 2)))(z, w, mat)
  _, kept = capacity_moe(z, idx, w, lambda b: b, e, rows, 2)
  assert 0 < int(jnp.sum(~kept)) < kept.size  # some pairs dropped, some kept
  np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
  for a, b in zip(ours[1], ref[1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def take_form_dropless_moe(z, idx, weights, experts, num_experts):
  """The dropless dispatch written with take / scatter and differentiated by JAX (its
  backward scatter-adds rows)."""
  n, k = idx.shape
  order = jnp.argsort(idx.reshape(-1), stable=True)
  sizes = jnp.bincount(idx.reshape(-1), length=num_experts).astype(jnp.int32)
  out_sorted = experts(jnp.take(z, order // k, axis=0), sizes)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
  out = jnp.take(out_sorted, inverse, axis=0).reshape(n, k, -1)
  return jnp.einsum("nk,nkl->nl", weights, out)


def dispatch_problem(seed: int, n=24, lat=6, hid=5, k=3, e=4):
  """A dispatch's inputs: z [n, lat], idx [n, k] (distinct experts a token), routing
  weights [n, k], the experts' GLU matrices, a cotangent for u, and e."""
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.normal(size=(n, lat)), jnp.float32)
  idx = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)
  w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
  shapes = ((e, lat, hid), (e, lat, hid), (e, hid, lat))
  mats = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  return z, idx, w, mats, jnp.asarray(rng.normal(size=(n, lat)), jnp.float32), e


def test_dropless_dispatch_is_gathers_both_ways():
  """The dropless dispatch (sorted rows as a capacity buffer of one slot per pair, the
  gather-only custom VJPs) against JAX's autodiff of the take / scatter form: u and the
  gradients of z, the routing weights and the expert matrices; its gradient scatter-adds no
  rows (slow on GPU; the take form's does)."""
  from conftest import jaxpr_eqns  # noqa: PLC0415
  from k3jax.model.moe_dispatch import dropless_moe, ragged_glu_experts  # noqa: PLC0415
  z, idx, w, mats, cot, e = dispatch_problem(seed=4)

  def loss(dispatch, z, w, mats):
    experts = ragged_glu_experts(*mats, lambda g, v: jnp.tanh(g) * v, jnp.float32)
    return jnp.sum(dispatch(z, idx, w, experts, e) * cot)

  grad = lambda d: jax.jit(jax.value_and_grad(functools.partial(loss, d), (0, 1, 2)))
  ours, ref = grad(dropless_moe)(z, w, mats), grad(take_form_dropless_moe)(z, w, mats)
  np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ref[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  eqns = jaxpr_eqns(jax.make_jaxpr(jax.grad(functools.partial(loss, dropless_moe),
                                            (0, 1, 2)))(z, w, mats).jaxpr)
  float_scatter_adds = [q for q in eqns if q.primitive.name == "scatter-add"
                        and jnp.issubdtype(q.outvars[0].aval.dtype, jnp.floating)]
  assert not float_scatter_adds  # (bincount's integer one counts the group sizes)


def test_token_chunks_dispatch_the_same_as_all_tokens_at_once():
  """moe.token_chunk: the dropless dispatch over 4 chunks of 6 tokens (a rematerialized
  loop) gives the u and the gradients (z, routing weights, expert matrices) of one
  dispatch of all 24; a chunk that does not divide the tokens is refused, naming both."""
  from k3jax.model.moe_dispatch import dropless_moe, ragged_glu_experts  # noqa: PLC0415
  z, idx, w, mats, cot, e = dispatch_problem(seed=5)

  def loss(chunk, z, w, mats):
    experts = ragged_glu_experts(*mats, lambda g, v: jnp.tanh(g) * v, jnp.float32)
    return jnp.sum(dropless_moe(z, idx, w, experts, e, token_chunk=chunk) * cot)

  def grad(chunk):
    return jax.jit(jax.value_and_grad(functools.partial(loss, chunk), (0, 1, 2)))(z, w, mats)
  whole, chunked = grad(0), grad(6)
  np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
  # the weight gradients sum over tokens in another order: relative to each array's norm
  for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1])):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
  with pytest.raises(ValueError, match="moe.token_chunk=5 does not divide the 24 tokens"):
    loss(5, z, w, mats)


def test_token_chunk_is_refused_by_the_capacity_dispatch():
  """A per-row capacity buffer cannot be cut into chunks: explicit in the config, and
  where "auto" resolves to capacity (CPU) at trace time."""
  from k3jax.config import ConfigError, validate  # noqa: PLC0415
  c = base_config()
  c.model.moe.dispatch, c.model.moe.token_chunk = "capacity", 64
  with pytest.raises(ConfigError, match="model.moe.token_chunk.*needs a dropless dispatch"):
    validate(c)
  _, module = make(dispatch="auto", token_chunk=8)
  with pytest.raises(ValueError, match="needs a dropless dispatch; moe.dispatch='auto' is "
                                       "'capacity' here"):
    forward(module, inputs(), None)


def test_auto_dispatch_per_platform():
  """moe.dispatch="auto": the dropless dispatch per device on TPU, and on GPU where the
  grouped-matmul kernel takes the experts' shapes (k3_small's, bf16) and no mesh axis
  splits the experts; capacity on CPU and on GPU otherwise (k3_tiny's shapes, fp32
  compute, gmm_backend="reference", experts over several GPUs)."""
  from k3jax.model.moe_dispatch import grouped_kernel_fits, resolve_dispatch  # noqa: PLC0415
  small = dict(rows=4096 * 8, latent=1024, hidden=768, num_experts=64)
  assert grouped_kernel_fits(**small, dtype=jnp.bfloat16)
  assert not grouped_kernel_fits(**small, dtype=jnp.float32)
  assert not grouped_kernel_fits(**small, dtype=jnp.bfloat16, backend="reference")
  # k3_tiny's: the latent (64) is narrower than the weight gradient's row block (128)
  assert not grouped_kernel_fits(rows=128 * 4, latent=64, hidden=128, num_experts=16,
                                 dtype=jnp.bfloat16)
  assert resolve_dispatch("auto", "tpu") == "expert_parallel_dropless"
  assert resolve_dispatch("auto", "gpu", grouped_kernel=True) == "expert_parallel_dropless"
  assert resolve_dispatch("auto", "gpu", grouped_kernel=False) == "capacity"
  # experts split over GPUs: no ragged all-to-all (XLA's GPU one is unproven here)
  assert resolve_dispatch("auto", "gpu", grouped_kernel=True, experts_split=True) == "capacity"
  assert resolve_dispatch("auto", "tpu", experts_split=True) == "expert_parallel_dropless"
  from k3jax.model.expert_parallel import experts_split  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "expert"))
  with use_rules(mesh, [("batch", "data"), ("experts", "expert")]):
    assert experts_split(mesh)
  with use_rules(mesh, [("batch", ("data", "expert")), ("experts", None)]):
    assert not experts_split(mesh)
  assert not experts_split(None)
  assert resolve_dispatch("auto", "cpu", grouped_kernel=True) == "capacity"
  assert resolve_dispatch("capacity", "tpu") == "capacity"


def test_mxfp4_experts_run_on_the_grid_with_straight_through_gradients():
  """moe.expert_quant="mxfp4" (QAT): the layer computes what the plain layer computes with
  its routed experts' weights replaced by their MXFP4 values (groups of 32 along each
  matrix's input axis), and its gradients are the plain layer's at those values."""
  from k3jax.model import mxfp4  # noqa: PLC0415
  cfgs = {q: tiny_model_cfg(expert_dim=64, latent_dim=32, expert_quant=q, dispatch="capacity")
          for q in ("mxfp4", "none")}
  for cfg in cfgs.values():
    cfg.d_model = 32
  qat, plain = build(cfgs["mxfp4"]), build(cfgs["none"])
  nnx.update(plain, nnx.state(qat))
  for name in ("w_g", "w_u", "w_d"):
    w = getattr(qat, name)[...]
    getattr(plain, name)[...] = mxfp4.fake_quantize(w)
    assert np.abs(np.asarray(getattr(plain, name)[...] - w)).max() > 1e-3   # not on the grid
  x = jax.random.normal(jax.random.key(3), (2, 8, 32), jnp.float32)
  valid = jnp.ones((2, 8), bool)
  r = jax.random.normal(jax.random.key(4), (2, 8, 32), jnp.float32)

  def loss_and_grads(module):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params):
      y, _ = nnx.merge(graphdef, params, rest)(x, valid)
      return jnp.sum(y * r), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return y, g

  (y_q, g_q), (y_p, g_p) = loss_and_grads(qat), loss_and_grads(plain)
  np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y_p))
  for a, b in zip(jax.tree.leaves(g_q), jax.tree.leaves(g_p)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

"""Expert-parallel Stable LatentMoE (moe.dispatch = "expert_parallel") on 8 simulated
devices: output, aux and gradients equal the unsharded capacity dispatch; the all-to-alls
carry latent-wide buffers, never d_model-wide rows, and routing gathers no scores across
devices; the Quantile-Balancing bias solved from the sharded step's histograms equals the
unsharded one; meshes that cannot split the experts are refused with the field named."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from conftest import micro_config, ragged_all_to_all_by_gather, random_model, rel
from k3jax import axes, parallel
from k3jax.config import ConfigError, validate
from k3jax.model import quantile_balancing as qb
from k3jax.model.latent_moe import LatentMoE

# One pytest-xdist worker for the module (--dist loadgroup): its module-wide fixtures and
# cached reference runs compile once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_expert_parallel")

B, T = 8, 32
CAPACITY_FACTOR = 1.25   # C = ceil(1.25 * 32 * 2 / 8) = 10 per row: some pairs are dropped
MESHES = [dict(expert=8), dict(expert=4, data=2), dict(expert=2, fsdp=2, tensor=2)]
MESH_IDS = ["-".join(f"{k}{v}" for k, v in s.items()) for s in MESHES]


def _cfg(dispatch, **mesh):
  c = micro_config()
  c.model.moe.dispatch, c.model.moe.capacity_factor = dispatch, CAPACITY_FACTOR
  c.model.moe.expert_dim = 24   # distinct from d_model (32) and latent (16) in the HLO
  for axis in parallel.MESH_AXES:
    c.mesh[axis] = mesh.get(axis, 1)
  return validate(c)


def _step(graphdef, params, rest, x, valid, cot):
  """(y [B, T, d], aux, grads w.r.t. the parameters, grad w.r.t. x) of sum(y * cot)."""
  def loss(params, x):
    y, aux = nnx.merge(graphdef, params, rest)(x, valid)
    return jnp.sum(y * cot), (y, aux)
  (_, (y, aux)), (g_params, g_x) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
  return y, aux, g_params, g_x


@functools.cache
def _problem():
  """Random weights, inputs with padded tails, and the unsharded capacity run's results."""
  cfg = _cfg("capacity")
  graphdef, params, rest = nnx.split(random_model(cfg.model, model_cls=LatentMoE),
                                     nnx.Param, ...)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, T, cfg.model.d_model)).astype(np.float32)
  valid = np.arange(T)[None, :] < np.array([T, T - 5, T, T - 9, T, T, T - 1, T])[:, None]
  cot = rng.standard_normal(x.shape).astype(np.float32)
  data = (nnx.as_pure(params), nnx.as_pure(rest), x, valid, cot)
  want = jax.device_get(jax.jit(functools.partial(_step, graphdef))(*data))
  assert int(want[1]["dropped"]) > 0   # the buffers overflow: dropping is exercised
  return cfg, params, rest, data, want


def _placed(mesh, params, rest, data):
  """The step's arguments (params, rest, x, valid, cot) put where the mesh rules say."""
  p, r, x, valid, cot = data
  rows = NamedSharding(mesh, parallel.batch_spec())
  return (jax.device_put(p, parallel.shardings(mesh, params)),
          jax.device_put(r, parallel.shardings(mesh, rest)),
          jax.device_put(x, rows), jax.device_put(valid, rows), jax.device_put(cot, rows))


@pytest.fixture(scope="module", params=MESHES, ids=MESH_IDS)
def sharded(request):
  """The same step with dispatch "expert_parallel" under the mesh: (results, compiled HLO)."""
  cfg, params, rest, (p, r, x, valid, cot), _ = _problem()
  cfg = _cfg("expert_parallel", **request.param)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg.model, rngs=nnx.Rngs(0))))
  mesh = parallel.make_mesh(cfg.mesh)
  args = _placed(mesh, params, rest, (p, r, x, valid, cot))
  with axes.use_rules(mesh, parallel.RULES):
    compiled = jax.jit(functools.partial(_step, graphdef)).lower(*args).compile()
  return request.param, jax.device_get(compiled(*args)), compiled.as_text()


def test_output_aux_and_gradients_equal_the_unsharded_capacity_dispatch(sharded):
  _, (y, aux, g_params, g_x), _ = sharded
  *_, (y1, aux1, g_params1, g_x1) = _problem()
  assert rel(y, y1) < 1e-5
  for key in ("counts", "load", "dropped"):
    np.testing.assert_array_equal(aux[key], aux1[key], err_msg=key)
  assert rel(g_x, g_x1) < 1e-5
  flat = dict(nnx.to_flat_state(g_params))
  for path, g1 in nnx.to_flat_state(g_params1):
    assert rel(flat[path], g1) < 1e-5, path
  assert {("w_g",), ("w_u",), ("w_d",), ("w_down", "kernel")} <= set(flat)


def _collective_shapes(hlo: str, op: str) -> list[list[tuple[int, ...]]]:
  """Per `op` (e.g. "all-to-all") of compiled HLO text, the shapes it produces. The result
  type is read: the CPU compiler prints operands by name only (and splits an all-to-all
  into one tuple piece per peer, each the shape of its operand)."""
  ops = []
  for line in hlo.splitlines():
    m = re.search(rf"= (.*?) {op}\(", line)
    if m:
      ops.append([tuple(int(d) for d in dims.split(",") if d)
                  for dims in re.findall(r"[a-z0-9]+\[([\d,]*)\]", m.group(1))])
  return ops


def test_all_to_all_carries_the_latent_not_the_hidden(sharded):
  sizes, _, hlo = sharded
  m = micro_config().model
  rows = B // math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert"))
  capacity = math.ceil(CAPACITY_FACTOR * T * m.moe.top_k / m.moe.num_experts)
  ops = _collective_shapes(hlo, "all-to-all")
  assert len(ops) >= 4, ops    # forward there and back, and the same in the backward
  for shapes in ops:
    assert all(s[-1] == m.moe.latent_dim != m.d_model for s in shapes), shapes
    # each moves one device's buffers: its rows for every expert (or, on the way back, its
    # experts' outputs for the rows of all peers): E * rows * C * L elements either way
    assert sum(map(math.prod, shapes)) == (m.moe.num_experts * rows * capacity
                                           * m.moe.latent_dim), shapes


def test_routing_stays_on_each_device(sharded):
  """top_k runs per device (`latent_moe.route_per_device`): left to XLA's partitioner it
  all-gathers every token's router scores [B * T, E] to every device."""
  _, _, hlo = sharded
  e = micro_config().model.moe.num_experts
  gathered = [s for shapes in _collective_shapes(hlo, "all-gather") for s in shapes]
  assert gathered and not {(B * T, e), (B, T, e)} & set(gathered), gathered


def test_balancing_bias_from_sharded_histograms_equals_unsharded(sharded):
  """Histograms are global sums over every data-parallel device, so the bias solved from
  them (under the mesh, bias sharded over experts) is the unsharded one."""
  sizes, (_, aux, _, _), _ = sharded
  cfg, params, rest, (_, r, _, valid, _), (_, aux1, _, _) = _problem()
  m = cfg.model
  assert int(np.sum(aux["counts"])) == int(valid.sum()) * m.moe.num_experts
  bias1 = np.asarray(rest["bias"][...])
  solve = jax.jit(qb.solve_bias, static_argnums=2)
  want = solve(aux1["counts"], bias1, m.moe.top_k)
  mesh = parallel.make_mesh(_cfg("expert_parallel", **sizes).mesh)
  bias = jax.device_put(bias1, parallel.shardings(mesh, rest)["bias"])
  with axes.use_rules(mesh, parallel.RULES):
    got = solve(jax.device_put(aux["counts"], NamedSharding(mesh, axes.logical_to_spec(
        ("experts", None)))), bias, m.moe.top_k)
  np.testing.assert_array_equal(aux["counts"], aux1["counts"])
  # Same histograms; the solve itself rounds differently when the bias it mean-centres is
  # split over devices: interpolation happens at |r| ~ 1 (bins span [min b - 1, max b + 1]),
  # so one rounding there is ~1.2e-7.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=3e-7)
  assert np.abs(np.asarray(want) - bias1).max() > 0   # the step's bias really moved


def test_experts_that_do_not_split_over_the_expert_axis_are_refused():
  c = micro_config()
  c.model.moe.dispatch, c.model.moe.num_experts = "expert_parallel", 6
  c.mesh.expert, c.mesh.data = 4, 2
  with pytest.raises(ConfigError, match=r"config.mesh.expert: 4 does not divide "
                                        r"model.moe.num_experts=6"):
    validate(c)
  # a mesh built without validate: the layer names the axis and the field when traced
  layer = random_model(c.model, model_cls=LatentMoE)
  mesh = parallel.make_mesh(c.mesh)
  x = jnp.zeros((8, 4, c.model.d_model), jnp.float32)
  with axes.use_rules(mesh, parallel.RULES), pytest.raises(
      ValueError, match=r"mesh axis 'expert' \(4 devices\) does not divide "
                        r"model.moe.num_experts=6"):
    jax.eval_shape(lambda x: layer(x)[0], x)


@pytest.mark.parametrize("sizes,token_chunk", [
    (dict(data=4, fsdp=2), 0), (dict(expert=2, fsdp=2, tensor=2), 0),
    (dict(expert=2, fsdp=2, tensor=2), 16)],
    ids=["data4-fsdp2", "expert2-fsdp2-tensor2", "expert2-fsdp2-tensor2-chunk16"])
def test_per_device_dropless_equals_unsharded_dropless(sizes, token_chunk, monkeypatch):
  """moe.dispatch = "expert_parallel_dropless": each device sorts its own pairs; over
  expert=2 the rows travel to their experts' owners by ragged all-to-all (on CPU the op as
  its docstring defines it, `conftest.ragged_all_to_all_by_gather`, so what is checked is
  the dispatch's offsets, sizes and regrouping). Output, aux and every gradient equal the
  unsharded dropless layer's; nothing is dropped. With moe.token_chunk each device routes
  its tokens 16 at a time (several chunks a device, each its own all-to-alls)."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", ragged_all_to_all_by_gather)
  cfg, params, rest, (p, r, x, valid, cot), _ = _problem()
  plain = _cfg("dropless")
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(plain.model, rngs=nnx.Rngs(0))))
  y1, aux1, g_params1, g_x1 = jax.device_get(
      jax.jit(functools.partial(_step, graphdef))(p, r, x, valid, cot))
  cfg = _cfg("expert_parallel_dropless", **sizes)
  cfg.model.moe.token_chunk = token_chunk
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: LatentMoE(cfg.model, rngs=nnx.Rngs(0))))
  mesh = parallel.make_mesh(cfg.mesh)
  args = _placed(mesh, params, rest, (p, r, x, valid, cot))
  with axes.use_rules(mesh, parallel.RULES):
    y, aux, g_params, g_x = jax.device_get(jax.jit(functools.partial(_step, graphdef))(*args))
  assert int(aux["dropped"]) == 0 and rel(y, y1) < 1e-5 and rel(g_x, g_x1) < 1e-5
  for key in ("counts", "load"):
    np.testing.assert_array_equal(aux[key], aux1[key], err_msg=key)
  flat = dict(nnx.to_flat_state(g_params))
  for path, g1 in nnx.to_flat_state(g_params1):
    assert rel(flat[path], g1) < 1e-5, path

"""The train step: microbatched (gradient accumulation) vs the whole batch at once; the LM
head and loss in sequence chunks vs the whole logits (the loss alone: test_lm_loss.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from k3jax import config as k3config
from k3jax import parallel, program


def _batch(cfg, seed=0):
  """Two documents per row in places, and padding, so that microbatches hold different
  token counts and the loss denominator matters."""
  t = cfg.train
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1))
  seg = np.ones((t.global_batch, t.seq_len), np.int32)
  seg[::2, t.seq_len // 3:] = 2
  for r in range(t.global_batch):
    seg[r, t.seq_len - 3 * r:] = 0  # row r ends with 3r padding tokens
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "segment_ids": seg, "positions": np.zeros_like(seg),
          "weights": (seg > 0).astype(np.float32)}


def _one_step(microbatches, loss_chunk=0):
  """One train step and an eval of the new state. 5 layers: one scanned [KDA x 3, MLA]
  cycle and the final MLA, all MoE, so that aux of both layer groups is merged; AdamW,
  the cheaper compile (the gradient is compared through out["grad_norm"], the update
  through the parameters and optimizer state)."""
  cfg = micro_config()
  cfg.model.num_layers, cfg.model.dense_layers = 5, 0
  cfg.optimizer.name = "adamw"
  cfg.train.global_batch, cfg.train.microbatches = 8, microbatches
  cfg.train.loss_chunk = loss_chunk
  cfg.mesh.data = 4
  k3config.validate(cfg)
  mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:4])
  prog = program.build(cfg, mesh)
  batch = jax.device_put(_batch(cfg), prog.batch_shardings)
  with prog.rules():
    state = prog.init()
    *state, out = prog.train_step(*state, batch)
    eval_loss = prog.eval_step(state[0], state[1], batch)
  return jax.device_get((state, out, eval_loss))


@pytest.fixture(scope="module")
def whole():
  return _one_step(1)


# the tests that read `whole` run in one pytest-xdist worker, which builds it once
WHOLE = pytest.mark.xdist_group("steps_whole")


@WHOLE
def test_microbatched_step_equals_whole_batch(whole):
  """2 microbatches of 4 rows on a 4-way data-parallel mesh: the same loss, load
  statistics, max logits, updated parameters, optimizer state and Quantile-Balancing
  biases as the 8 rows at once (fp32)."""
  _assert_same_step(_one_step(2), whole)


@WHOLE
def test_step_with_chunked_loss_equals_whole_logits(whole):
  """The LM head + loss 8 positions at a time (4 chunks of the 32, each differentiated in
  its forward): the same step as with the whole [B, T, V] logits: loss, gradient norm,
  updated state."""
  _assert_same_step(_one_step(1, loss_chunk=8), whole)


def _assert_same_step(step, whole):
  """Two steps' (state, out, eval loss) agree: outputs, eval loss, every state leaf (fp32)."""
  (state, out, eval_loss), (ref_state, ref_out, ref_eval) = step, whole
  assert set(out) == set(ref_out)
  for k in out:
    np.testing.assert_allclose(out[k], ref_out[k], rtol=2e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(eval_loss, ref_eval, rtol=1e-6)
  flat, ref_flat = jax.tree.leaves_with_path(state), jax.tree.leaves(ref_state)
  for (path, x), y in zip(flat, ref_flat, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_step_scatters_only_what_it_must():
  """The train step's scatters (dropless dispatch, one device) that XLA's deterministic mode
  rewrites element by element (neither integer sums nor marked unique) come only from the
  embedding's gradient and the pure-JAX KDA form: none from the loss, the router or the
  dispatch's permutations."""
  from conftest import jaxpr_eqns  # noqa: PLC0415
  cfg = micro_config()
  cfg.model.num_layers, cfg.model.dense_layers = 5, 0
  cfg.model.moe.dispatch = "dropless"
  k3config.validate(cfg)
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  with prog.rules():
    jaxpr = jax.make_jaxpr(prog.train_step)(*prog.abstract_state, prog.abstract_batch())
  rewritten = [e for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name.startswith("scatter")
               and not e.params["unique_indices"]
               and not (e.primitive.name == "scatter-add"
                        and jnp.issubdtype(e.invars[0].aval.dtype, jnp.integer))]
  table = prog.abstract_params["embed"].value.shape
  kda_form = lambda shape: len(shape) == 7  # noqa: E731  (its blocked solve's tiles)
  shapes = {e.invars[0].aval.shape for e in rewritten}
  assert table in shapes
  assert {s for s in shapes if s != table and not kda_form(s)} == set()


def test_deterministic_programs_trace_with_the_deterministic_kernels():
  """train.deterministic reaches the kernels' dispatchers: a program's steps trace inside
  `pallas_kernels.backends.deterministic()` exactly when its config asks for it."""
  from pallas_kernels import backends  # noqa: PLC0415
  for on in (False, True):
    cfg = micro_config()
    cfg.train.deterministic = on
    prog = program.build(k3config.validate(cfg), parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
    with prog.rules():
      assert backends.deterministic_only() is on
    assert backends.deterministic_only() is False


def test_init_draws_with_one_threefry_kernel_on_gpus():
  """Inside `Program.rules()` a program's init lowered for CUDA calls threefry as custom
  calls (one kernel each), not its expansion into shifts and adds; outside, the flag is as
  it was. The GPU run that measured the compile gave the same 680 arrays bit for bit
  (benchmarks/results/compile_time.md)."""
  cfg = micro_config()
  prog = program.build(k3config.validate(cfg), parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  lower = lambda: prog.init.trace().lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
  before = jax.config.jax_threefry_gpu_kernel_lowering
  with prog.rules():
    inside = lower()
  assert jax.config.jax_threefry_gpu_kernel_lowering == before
  outside = lower()
  assert inside.count("cu_threefry2x32") > 0 and "stablehlo.shift_left" not in inside
  assert "cu_threefry2x32" not in outside and "stablehlo.shift_left" in outside


def test_train_draws_its_fresh_state_inside_the_rules():
  """`k3jax.train` (no checkpoint, no init_from) calls the program's init inside
  `Program.rules()`, so on GPUs the draw compiles as one threefry kernel per array."""
  from k3jax import train  # noqa: PLC0415
  cfg = k3config.validate(micro_config())
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  seen = []

  def init():
    seen.append(jax.config.jax_threefry_gpu_kernel_lowering)
    return "state"

  class NoCheckpoint:
    def restore_latest(self, *args, **kwargs):
      return None

  step, state, _ = train.start_state(cfg, dataclasses.replace(prog, init=init), NoCheckpoint(),
                                     None, "", "{}")
  assert (step, state, seen) == (0, "state", [True])


def test_microbatches_must_split_the_batch_over_devices():
  cfg = micro_config()
  cfg.train.global_batch, cfg.train.microbatches = 6, 4
  with pytest.raises(k3config.ConfigError, match="train.microbatches"):
    k3config.validate(cfg)
  cfg.train.global_batch, cfg.train.microbatches, cfg.mesh.data = 8, 4, 4
  mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:4])
  with pytest.raises(k3config.ConfigError, match="do not each split over the 4"):
    program.build(k3config.validate(cfg), mesh)


def test_cast_params_once_without_routed_experts_is_the_same_step():
  """A model of dense FFNs alone: train.cast_params_once casts its matrices once (bf16
  compute) with no module to mark prepared (it failed), and steps bitwise as without it."""
  def step(cast_once):
    cfg = micro_config()
    cfg.model.num_layers, cfg.model.mla_every, cfg.model.dense_layers = 3, 3, 3
    cfg.model.dtype = "bfloat16"
    cfg.optimizer.name = "adamw"
    cfg.train.cast_params_once = cast_once
    cfg.train.xla_options = "xla_allow_excess_precision=false"   # as below
    k3config.validate(cfg)
    prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
    batch = jax.device_put(_batch(cfg), prog.batch_shardings)
    with prog.rules():
      *state, out = prog.train_step(*prog.init(), batch)
    return jax.device_get((state, out))

  (state, out), (ref_state, ref_out) = step(True), step(False)
  np.testing.assert_array_equal(out["loss"], ref_out["loss"])
  np.testing.assert_array_equal(out["grad_norm"], ref_out["grad_norm"])
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
    np.testing.assert_array_equal(x, y)


def test_cast_params_once_gives_the_same_step():
  """train.cast_params_once (the routed expert matrices MXFP4-quantized and cast to bf16, the
  other matrices cast, once per step, before the microbatches): bitwise the same loss,
  gradient norm and updated state as the model's own quantization and casts in every
  microbatch's forward and remat recompute (moe.expert_quant="mxfp4", bf16 compute, 2
  microbatches, full remat); the expert matrices get the quantizing view, every other
  Dense kernel but the fp32 router a bf16 cast, norms and biases none. (Without
  xla_allow_excess_precision=false the gradient norm differs in the 6th digit on CPU.)"""
  from k3jax.model.layers import ComputeView, compute_views  # noqa: PLC0415

  def step(cast_once):
    cfg = micro_config()
    # one scanned [KDA, MLA] cycle and the final MLA
    cfg.model.num_layers, cfg.model.mla_every, cfg.model.dense_layers = 3, 2, 0
    cfg.model.dtype, cfg.model.remat = "bfloat16", "full"
    cfg.model.moe.latent_dim, cfg.model.moe.expert_quant = 32, "mxfp4"
    cfg.optimizer.name = "adamw"
    cfg.train.global_batch, cfg.train.microbatches = 4, 2
    cfg.train.cast_params_once = cast_once
    # XLA may otherwise drop a bf16 round trip (f32 -> bf16 -> f32 around a CPU dot) where
    # it sees one, i.e. only where the cast sits next to the dot: the two programs would
    # round differently, which a GPU's native bf16 dot never does
    cfg.train.xla_options = "xla_allow_excess_precision=false"
    k3config.validate(cfg)
    prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
    batch = jax.device_put(_batch(cfg), prog.batch_shardings)
    with prog.rules():
      state = prog.init()
      text = prog.train_step.lower(*state, batch).as_text()
      *state, out = prog.train_step(*state, batch)
    return jax.device_get((state, out)), prog, text

  (state, out), prog, text = step(True)
  (ref_state, ref_out), _, ref_text = step(False)
  quantizes = lambda program: program.count("shift_right_logical")  # noqa: E731
  assert 0 < quantizes(text) < quantizes(ref_text)   # once a step, not in every forward
  every = {jax.tree_util.keystr(p): v for p, v in
           jax.tree.leaves_with_path(compute_views(prog.abstract_params))}
  experts = {n for n in every if n.endswith(("['w_g']", "['w_u']", "['w_d']"))}
  dense = {n for n in every if n.endswith("['kernel']") and "['router']" not in n}
  assert experts and {every[n] for n in experts} == {ComputeView("bfloat16", "mxfp4")}
  assert dense and {every[n] for n in dense} == {ComputeView("bfloat16", "")}
  assert {n for n, v in every.items() if v} == experts | dense
  for k in ref_out:
    np.testing.assert_array_equal(out[k], ref_out[k], err_msg=k)
  for (path, x), y in zip(jax.tree.leaves_with_path(state), jax.tree.leaves(ref_state),
                          strict=True):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))



def test_unrolled_cycles_sliced_once_a_step_give_the_same_step():
  """scan_layers=False: the cycles' stacked leaves sliced once a step (`stacks`, as
  program.build passes them) or by the model in every microbatch's forward: bitwise the same
  loss, gradient norm and updated state, and the compiled step slices the stacks fewer
  times."""
  from flax import nnx  # noqa: PLC0415

  from k3jax.model import K3Model  # noqa: PLC0415
  from k3jax.steps import make_steps  # noqa: PLC0415

  cfg = micro_config()
  # two [KDA, MLA] cycles alone, no AttnRes: the smallest unrolled stack with stacked leaves
  cfg.model.num_layers, cfg.model.mla_every, cfg.model.dense_layers = 4, 2, 0
  cfg.model.final_mla, cfg.model.attn_res.enabled, cfg.model.scan_layers = False, False, False
  cfg.optimizer.name = "adamw"
  cfg.train.global_batch, cfg.train.microbatches = 4, 2
  k3config.validate(cfg)
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  stacks = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0))).unrolled_stacks(
      prog.abstract_params)
  assert sorted(set(jax.tree.leaves(stacks))) == [0, 2]   # two cycles; the rest unstacked
  batch = _batch(cfg)
  state = prog.init()

  def run(stacks):
    step = jax.jit(make_steps(prog.graphdef, prog.tx, microbatches=2, stacks=stacks)[0])
    compiled = step.lower(*state, batch).compile()
    return jax.device_get(compiled(*state, batch)), compiled.as_text().count(" slice(")

  (got, slices), (want, ref_slices) = run(stacks), run(None)
  assert slices < ref_slices, (slices, ref_slices)
  for (path, x), y in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))

"""The training program of a config on a mesh, shared by `k3jax.train` and `k3jax.aot`.

  program = build(cfg, mesh)
  with program.rules():                          # the model's logical axes -> the mesh
    params, rest, opt_state = program.fresh_state()   # every array created where it lives
    params, rest, opt_state, out = program.train_step(params, rest, opt_state, batch)"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import axes, checkpoint, optim, parallel
from k3jax.config import MODEL_RESTORE_FIELDS, ConfigError, check_context, xla_options
from k3jax.data import MediaSpec, feature_shapes
from k3jax.model import K3Model
from k3jax.model.layers import compute_views
from k3jax.steps import make_steps
from pallas_kernels import backends


def batch_shapes(cfg) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{feature: (shape, dtype)} of the global batch `cfg`'s pipeline gives."""
  return feature_shapes(cfg.data, seq_len=cfg.train.seq_len, batch=cfg.train.global_batch,
                        media=MediaSpec.from_config(cfg.model.vision))


@dataclasses.dataclass(frozen=True)
class Program:
  """What `build` returns; state is the pure triple (params, rest, opt_state)."""
  cfg: Any
  mesh: Mesh
  graphdef: Any
  tx: optax.GradientTransformation
  abstract_params: Any            # nnx.State of the parameters, with metadata (no arrays)
  state_shardings: tuple          # (params, rest, opt_state) NamedShardings
  abstract_state: tuple           # the same, as ShapeDtypeStructs carrying the shardings
  batch_shardings: dict[str, NamedSharding]   # per feature of the batch (`batch_shapes`)
  init: Any                       # jitted () -> state
  train_step: Any                 # jitted (params, rest, opt_state, batch) -> (*state, out)
  eval_step: Any                  # jitted (params, rest, batch) -> loss

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_params))

  @property
  def state_bytes(self) -> int:
    """Bytes of the whole train state over all devices (each array counted once)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.abstract_state))

  @contextlib.contextmanager
  def rules(self):
    """Installs the mesh rules, with train.deterministic the kernels that repeat bit for bit,
    and `threefry_as_one_kernel`; trace, lower and call the steps inside it."""
    with (axes.use_rules(self.mesh, parallel.rules(self.cfg.mesh.expert_splits)),
          backends.deterministic(self.cfg.train.deterministic), threefry_as_one_kernel()):
      yield

  def fresh_state(self) -> tuple:
    """`init()` inside `rules()`: each array drawn where it lives, threefry one GPU kernel."""
    with self.rules():
      return self.init()

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch's arrays, sharded as `batch_shardings` says."""
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_shardings[name])
            for name, (shape, dtype) in batch_shapes(self.cfg).items()}

  def lower_train_step(self) -> jax.stages.Lowered:
    """The train step lowered on the abstract state and batch (nothing is allocated)."""
    with self.rules():
      return self.train_step.lower(*self.abstract_state, self.abstract_batch())


@contextlib.contextmanager
def threefry_as_one_kernel():
  """On GPUs, threefry (each parameter's initial draw) lowers to one CUDA kernel rather than
  to its expansion in HLO ops, which XLA compiles several times slower; the same bits."""
  flag = "jax_threefry_gpu_kernel_lowering"
  before = getattr(jax.config, flag)
  jax.config.update(flag, True)
  try:
    yield
  finally:
    jax.config.update(flag, before)


def build(cfg, mesh: Mesh) -> Program:
  """The program of `cfg` on `mesh`; ConfigError if the batch or a parameter won't split."""
  t = cfg.train
  table = parallel.rules(cfg.mesh.expert_splits)
  batch_axes, seq_axes = (axes.mesh_axes(name, table) for name in ("batch", "seq"))
  data_ways = math.prod(mesh.shape[a] for a in batch_axes)
  over = " x ".join(batch_axes)
  if t.global_batch % data_ways:
    raise ConfigError(f"config.train.global_batch: {t.global_batch} rows do not split over "
                      f"the {data_ways} data-parallel devices ({over})")
  if t.global_batch % (t.microbatches * data_ways):
    raise ConfigError(f"config.train.microbatches: {t.microbatches} microbatches of "
                      f"{t.global_batch} rows do not each split over the {data_ways} "
                      f"data-parallel devices ({over})")
  check_context(cfg, math.prod(mesh.shape[a] for a in seq_axes))
  abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(cfg.seed)))
  graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
  parallel.check_divisible(abs_params, mesh)
  parallel.check_divisible(abs_rest, mesh)
  tx, _ = optim.make_optimizer(cfg, abs_params, mesh=mesh,
                               param_specs=parallel.param_specs(abs_params))
  param_sh, opt_sh = parallel.state_shardings(mesh, tx, abs_params)
  state_sh = (param_sh, parallel.shardings(mesh, abs_rest), opt_sh)

  @functools.partial(jax.jit, out_shardings=state_sh)
  def init():
    model = K3Model(cfg.model, rngs=nnx.Rngs(cfg.seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    return params, rest, tx.init(params)

  abstract_state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      jax.eval_shape(init), state_sh)
  train_step, eval_step = make_steps(
      graphdef, tx, qk_clip_tau=cfg.optimizer.qk_clip_tau, microbatches=t.microbatches,
      loss_chunk=t.loss_chunk, loss_backend=t.loss_backend,
      views=compute_views(abs_params) if t.cast_params_once else None,
      stacks=abstract.unrolled_stacks(abs_params))
  options = compiler_options(t.xla_options, mesh, deterministic=t.deterministic)
  return Program(
      cfg=cfg, mesh=mesh, graphdef=graphdef, tx=tx,
      abstract_params=abs_params, state_shardings=state_sh, abstract_state=abstract_state,
      batch_shardings=batch_shardings(cfg, mesh), init=init,
      train_step=jax.jit(train_step, donate_argnums=(0, 1, 2),
                         out_shardings=(*state_sh, None), compiler_options=options),
      eval_step=jax.jit(eval_step, compiler_options=options))


def batch_shardings(cfg, mesh: Mesh) -> dict[str, NamedSharding]:
  """Batch shardings: text [B, T] as [batch, seq], `media_*` by rows alone."""
  text = parallel.batch_spec(parallel.rules(cfg.mesh.expert_splits))
  return {name: NamedSharding(mesh, P(text[0]) if name.startswith("media_") else text)
          for name in batch_shapes(cfg)}


# train.deterministic: the XLA options that make a platform's programs repeat bit for bit
DETERMINISTIC = {"gpu": {"xla_gpu_deterministic_ops": "true"}}


def compiler_options(spec: str, mesh: Mesh, *,
                     deterministic: bool = False) -> dict[str, str | bool] | None:
  """train.xla_options (and `DETERMINISTIC` ones) for `mesh`'s platform, checked by
  compiling a scalar program first: ConfigError naming an unknown option. "true"/"false"
  become bools on CPU and GPU."""
  platform = mesh.devices.flat[0].platform
  options = xla_options(spec, platform)
  if deterministic:
    options = {**DETERMINISTIC.get(platform, {}), **options}
  if not options:
    return None
  if platform != "tpu":
    options = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in options.items()}
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
  try:
    jax.jit(lambda x: x + 1, compiler_options=options).lower(scalar).compile()
  except Exception as e:  # noqa: BLE001  (XLA raises its runtime error type)
    raise ConfigError(f"config.train.xla_options: XLA on {platform} refuses {options} "
                      f"({str(e).splitlines()[0]})") from None
  return options


# Config fields the program does not depend on: configs differing only here share one.
RUN_ONLY_FIELDS = ("train.log_every", "train.eval_every", "train.eval_batches",
                   "train.eval_text", "train.eval_choices", "train.compilation_cache",
                   "train.checkpoint_every", "train.keep_checkpoints",
                   "train.keep_checkpoint_every", "train.max_bad_steps", "train.peak_tflops",
                   "train.skip_batches", "data",
                   # state of the optimizer, not constants of the step (optim.schedule)
                   "train.steps", "optimizer.learning_rate", "optimizer.warmup_steps",
                   "optimizer.min_lr_ratio")
_BUILT: collections.OrderedDict = collections.OrderedDict()
_KEEP_BUILT = 2


def program_key(cfg) -> str:
  """The config fields the program depends on, as JSON: configs with the same key build the
  same program on the same mesh."""
  fields = cfg.to_dict()
  for dotted in RUN_ONLY_FIELDS:
    *parents, leaf = dotted.split(".")
    section = functools.reduce(lambda d, k: d.get(k, {}), parents, fields)
    section.pop(leaf, None)
  # The data section is run-only except for the batch's arrays it implies (abstract_batch).
  fields["batch"] = {name: (shape, str(dtype)) for name, (shape, dtype)
                     in batch_shapes(cfg).items()}
  return json.dumps(fields, sort_keys=True, default=repr)


def build_once(cfg, mesh: Mesh) -> Program:
  """`build`, cached per process (the last two programs)."""
  key = (program_key(cfg), mesh)
  if key not in _BUILT:
    _BUILT[key] = build(cfg, mesh)
    while len(_BUILT) > _KEEP_BUILT:
      _BUILT.popitem(last=False)
  _BUILT.move_to_end(key)
  return _BUILT[key]


def restored_model(cfg, workdir: str) -> tuple[int, K3Model]:
  """(step, the model with `workdir`'s latest checkpoint's parameters), for generate/eval."""
  prog = build_once(cfg, parallel.make_mesh(cfg.mesh))
  step, params, rest = checkpoint.restore_params(
      workdir, prog.abstract_state, config_json=cfg.to_json(),
      must_match=MODEL_RESTORE_FIELDS, field="--workdir")
  return step, nnx.merge(prog.graphdef, params, rest)

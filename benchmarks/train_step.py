"""The train step and the optimizer step of one config, timed.

  python benchmarks/train_step.py --config=experiments/k3_small.py
  python benchmarks/train_step.py --config=experiments/k3_small.py --variants=muon:auto,adamw
  python benchmarks/train_step.py --config=experiments/k3_small.py --devices=2 \
      --config.mesh.expert=2 --config.model.moe.dispatch=expert_parallel --variants= \
      --nons_blocks
  # two configs on one GPU: compiled at once (minutes each), timed one after the other
  for v in false true; do XLA_PYTHON_CLIENT_PREALLOCATE=false python \
      benchmarks/train_step.py --config=experiments/k3_small.py --variants= --nons_blocks \
      --sharers=2 --share_dir=/tmp/share.$$ --config.train.cast_params_once=$v & done; wait
  # XLA options compared on one lowered step (compile and step time), in one process
  python benchmarks/train_step.py --config=experiments/k3_small.py --variants= --nons_blocks \
      --config.train.xla_options= --compile_with=xla_gpu_enable_triton_gemm=false
  # a second build (config overrides) against the config's, steps alternating on one state
  python benchmarks/train_step.py --config=experiments/k3_small.py --variants= --nons_blocks \
      --config.train.gpu_memory_fraction=0.95 --ab=train.microbatches=2

Issue 3 asks that the optimizer step (update + QK-Clip + apply) stays under 5% of the
train step (forward, backward, optimizer, Quantile Balancing). The train step is compiled
and timed once, with the config's optimizer; then the optimizer step alone is timed for
each variant ("muon:<ns_backend>" or "adamw") on random gradients. Synthetic tokens (one
document per row) keep the data pipeline out of the numbers. The train step is the very
program `k3jax.train` runs (`k3jax.program.build`, microbatches included) on a mesh over
the first --devices devices; its losses on the one batch, step after step, let runs on
different meshes be compared. Prints a markdown table.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from harness import header, paired

from k3jax import cli, memory, optim, parallel, program
from k3jax import data as k3data
from k3jax import config as k3config
from k3jax import flops
from k3jax.optim import muon
from pallas_kernels.newton_schulz import newton_schulz

_VARIANTS = flags.DEFINE_list("variants", ["muon:auto", "muon:reference", "adamw"],
                              "optimizer steps to time: muon:<ns_backend> or adamw")
WARMUP = 2  # untimed runs before each timed series (first-call compiles, the allocator's pool)
_REPS = flags.DEFINE_integer("reps", 10, f"timed repetitions (after {WARMUP} warm-up runs)")
_DEVICES = flags.DEFINE_integer("devices", 1, "devices of the train step's mesh (config.mesh "
                                "says how they split, e.g. --config.mesh.expert=2)")
_NS_BLOCKS = flags.DEFINE_bool("ns_blocks", True, "time Newton-Schulz alone per block shape")
_SHARERS = flags.DEFINE_integer(
    "sharers", 1, "processes sharing the GPU (with XLA_PYTHON_CLIENT_PREALLOCATE=false): "
    "each compiles its train step, waits for all to have compiled, then times it alone and "
    "exits, the others waiting; train step only (--variants= --nons_blocks)")
_SHARE_DIR = flags.DEFINE_string("share_dir", None, "a new directory where --sharers meet")
_SHARE_WAIT = flags.DEFINE_float("share_wait", 1800.0, "seconds a sharer waits for the others "
                                 "to compile (one refused at its flags leaves no mark)")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", None, "trace one more train step (after the timed ones) with the JAX "
    "profiler into this directory, with a Perfetto copy for benchmarks/gpu_trace.py")
_TRAIN_STEP = flags.DEFINE_bool("train_step", True, "also compile and time the train step "
                                "(minutes of compile for k3_small)")
_COMPILE_WITH = flags.DEFINE_multi_string(
    "compile_with", [], "after the train step, compile the same lowered step with each of these "
    "XLA option sets (\"name=value,...\", added to train.xla_options, later wins) and time it "
    "going on from the last state: compile and step times side by side in one process")

_AB = flags.DEFINE_multi_string(
    "ab", [], "a config override (\"train.microbatches=2\"; the flag again for more) of a "
    "second build, compiled after the train step and timed against it in this process, the "
    "two alternating on one state: each build's median step and their paired difference (the "
    "GPU memory share stays the config's)")


def first_batch(cfg) -> dict:
  """The global batch the step is timed on: synthetic tokens (one document per row), or with
  `data.images` the first batch of the config's own pipeline (the pictures and their
  placeholder runs cannot be made up)."""
  t = cfg.train
  if cfg.data.images.source != "none":
    ds = k3data.make_dataset(cfg.data, seq_len=t.seq_len, global_batch=t.global_batch,
                             seed=cfg.seed, media=k3data.MediaSpec.from_config(cfg.model.vision))
    batch = next(iter(ds))
    images = int(np.sum(np.asarray(batch["media_grid_thw"])[..., 0] > 0))
    patches = int(np.sum(np.asarray(batch["media_segment_ids"]) > 0))
    print(f"# first batch of the data pipeline: {images} images, {patches} patches, "
          f"{int(np.sum(batch['weights']))} weighted targets", flush=True)
    return {k: jnp.asarray(v) for k, v in batch.items()}
  return {k: jnp.asarray(v) for k, v in k3data.synthetic_batch(
      t.global_batch, t.seq_len, cfg.model.vocab_size).items()}


def timed(fn, *args, reps: int) -> tuple[float, object]:
  """Median seconds per call of fn(*args) -> (time, last output); args are not donated.
  Each call's output is freed before the next call: two outputs of k3_small's optimizer
  step beside its arguments do not fit an H100."""
  times = []
  for i in range(WARMUP + reps):
    out = None
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    if i >= WARMUP:
      times.append(time.perf_counter() - t0)
  return float(np.median(times)), out


def variant_config(cfg, variant: str):
  cfg = cfg.copy_and_resolve_references()
  name, _, backend = variant.partition(":")
  with cfg.unlocked():
    cfg.optimizer.name = name
    if backend:
      cfg.optimizer.muon.ns_backend = backend
  return k3config.validate(cfg)


def ns_blocks(cfg, abs_params):
  """Times Newton-Schulz alone on every Muon block of the model, grouped by block shape."""
  mu = cfg.optimizer.muon
  labels = jax.tree.leaves(muon.muon_labels(abs_params, router=mu.router))
  layouts = jax.tree.leaves(muon.block_layouts(abs_params, per_head=mu.per_head),
                            is_leaf=lambda x: x is None or isinstance(x, muon.BlockLayout))
  shapes = {}
  for label, lay in zip(labels, layouts):
    if label == "muon":
      key = (lay.fan_in, lay.fan_out)
      shapes[key] = shapes.get(key, 0) + math.prod(lay.batch)
  total = 0.0
  print("\n| Newton-Schulz alone: blocks | time |\n|---|---|")
  for (fi, fo), count in sorted(shapes.items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1]):
    x = jax.random.normal(jax.random.key(0), (count, fi, fo), jnp.dtype(mu.ns_dtype))
    ns = jax.jit(functools.partial(newton_schulz, steps=mu.ns_steps, backend=mu.ns_backend))
    secs = timed(ns, x, reps=_REPS.value)[0]
    total += secs
    print(f"| {count} x ({fi} x {fo}) | {secs * 1e3:.2f} ms |", flush=True)
    del x
  print(f"| all | {total * 1e3:.2f} ms |", flush=True)


def mark_sharer(state: str) -> pathlib.Path:
  """Leaves `state`.<pid> in --share_dir (made if new) for the other sharers; its path."""
  share = pathlib.Path(_SHARE_DIR.value)
  share.mkdir(parents=True, exist_ok=True)
  (share / f"{state}.{os.getpid()}").touch()
  return share


def wait_for_sharers():
  """With --sharers N: marks this process compiled, waits until N are, then takes the GPU's
  timing lock, held until the process exits (so its memory is freed before the next one
  times)."""
  if _SHARERS.value == 1:
    return
  share = mark_sharer("compiled")
  deadline = time.monotonic() + _SHARE_WAIT.value
  while (done := len(list(share.glob("compiled.*")))) < _SHARERS.value:
    if failed := list(share.glob("failed.*")):
      raise RuntimeError(f"a sharer stopped before compiling ({failed[0].name}; its log "
                         "says why): not waiting for it")
    if time.monotonic() > deadline:
      raise RuntimeError(f"{done} of --sharers={_SHARERS.value} compiled within "
                         f"--share_wait={_SHARE_WAIT.value:.0f} s in {share}")
    time.sleep(1.0)
  # a raw descriptor, never closed (no file object for the collector to close): the lock
  # lasts until the process exits
  fcntl.flock(os.open(share / "lock", os.O_WRONLY | os.O_CREAT, 0o644), fcntl.LOCK_EX)


def time_optimizer_steps(cfg, abs_params, params) -> dict[str, float]:
  """Median seconds of each --variants optimizer step (update + apply) on fixed gradients."""
  grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
  opt_times = {}
  for variant in _VARIANTS.value:
    vcfg = variant_config(cfg, variant)
    vtx, _ = optim.make_optimizer(vcfg, abs_params)

    def opt_step(params, opt_state, grads, vtx=vtx):
      updates, opt_state = vtx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    state = jax.jit(vtx.init)(params)
    opt_times[variant] = timed(jax.jit(opt_step), params, state, grads, reps=_REPS.value)[0]
    print(f"# optimizer step {variant}: {opt_times[variant] * 1e3:.2f} ms", flush=True)
    del state
  return opt_times


def one_step(step, state, batch) -> tuple[list, float, dict]:
  """(state after, seconds, outputs) of one step, waited for."""
  t0 = time.perf_counter()
  *state, out = step(*state, batch)
  jax.block_until_ready(out)
  return state, time.perf_counter() - t0, out


def run_steps(step, state, batch) -> tuple[list, list[float], list[float]]:
  """(state after, seconds of --reps steps after the warm-up ones, every step's loss)."""
  times, losses = [], []
  for i in range(WARMUP + _REPS.value):
    state, secs, out = one_step(step, state, batch)
    losses.append(float(out["loss"]))
    if i >= WARMUP:
      times.append(secs)
  return state, times, losses


def ab_config():
  """The validated config of this run's --config flags with the --ab overrides on top;
  ConfigError (one `config error:` line, exit 2) naming a typo."""
  args = sys.argv[1:]
  given = [a for i, a in enumerate(args) if a.startswith(("--config=", "--config."))
           or a == "--config" or (i and args[i - 1] == "--config")]
  try:
    return cli.config_from_args(["train_step", *given, *(f"--config.{o}" for o in _AB.value)])
  except k3config.ConfigError as e:
    raise k3config.ConfigError(f"--ab: {e}") from None


def ab_program(cfg_b, prog):
  """The --ab build on prog's mesh; ConfigError where it would not take prog's state."""
  prog_b = program.build(cfg_b, prog.mesh)
  spec = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
  if spec(prog_b.abstract_state) != spec(prog.abstract_state):
    raise k3config.ConfigError(f"--ab {_AB.value} changes the parameters or optimizer state: "
                               "the two builds cannot take turns on one state")
  return prog_b


def time_ab(prog_b, prog, step, state, batch):
  """--ab: prog_b's step compiled, then prog's step and prog_b's alternating on `state`;
  prints both medians and the paired difference. -> state."""
  cfg_b = prog_b.cfg
  with prog_b.rules():
    t0 = time.perf_counter()
    step_b = prog_b.lower_train_step().compile()
  print(f"# --ab build {_AB.value} compiled in {time.perf_counter() - t0:.0f} s", flush=True)
  runs = ((step, batch), (step_b, jax.device_put(batch, prog_b.batch_shardings)))
  times = ([], [])
  for i in range(WARMUP + _REPS.value):
    for (fn, inputs), out_times in zip(runs, times):
      state, secs, _ = one_step(fn, state, inputs)
      if i >= WARMUP:
        out_times.append(secs)
  a, b, diff, lo, hi = paired(*times)
  print(f"# alternating {_REPS.value} times: config {a * 1e3:.1f} ms (MFU {mfu_text(prog.cfg, a)}"
        f"), --ab {b * 1e3:.1f} ms (MFU {mfu_text(cfg_b, b)}, temporaries "
        f"{step_b.memory_analysis().temp_size_in_bytes / 2**30:.1f} GiB); --ab - config "
        f"{diff * 1e3:+.1f} ms a step (pairs {lo * 1e3:+.1f} to {hi * 1e3:+.1f})", flush=True)
  return state


def time_train_step(cfg, prog, batch, prog_b=None):
  """(compiled step, median seconds of --reps steps after the warm-up ones, every step's
  loss): prog's train step on batch (placed as prog's batch shardings), fresh state, the
  median logged at once;
  with --profile_dir one more step traced, its HLO beside the trace; then each
  --compile_with set's row and, given prog_b (--ab), `time_ab`'s."""
  t = cfg.train
  with prog.rules():
    # compiled before the state is drawn, as k3jax.train does: the autotuner's buffers come
    # and go in an empty pool, and the state sits at its low end
    t0 = time.perf_counter()
    lowered = prog.lower_train_step()
    step = lowered.compile()
    print(f"# train step compiled in {time.perf_counter() - t0:.0f} s "
          f"({t.microbatches} microbatches of {t.global_batch // t.microbatches} rows)",
          flush=True)
    wait_for_sharers()
    state = prog.fresh_state()
    state, times, losses = run_steps(step, state, batch)
    median_s = float(np.median(times))  # logged before what below may run out of memory
    print(f"# train step {median_s * 1e3:.1f} ms (median of {len(times)}), MFU "
          f"{mfu_text(cfg, median_s)}", flush=True)
    if _PROFILE_DIR.value:
      with jax.profiler.trace(_PROFILE_DIR.value, create_perfetto_trace=True):
        *state, out = step(*state, batch)
        jax.block_until_ready(out)
      # the program's HLO, whose op names gpu_trace.py maps kernels to components by
      pathlib.Path(_PROFILE_DIR.value, "train_step.hlo.txt").write_text(step.as_text())
    for spec in _COMPILE_WITH.value:
      options = program.compiler_options(f"{t.xla_options} {spec}", prog.mesh,
                                         deterministic=t.deterministic)
      t0 = time.perf_counter()
      other = lowered.compile(compiler_options=options)
      compile_s = time.perf_counter() - t0
      state, other_times, other_losses = run_steps(other, state, batch)
      secs = float(np.median(other_times))
      print(f"# compiled with {spec or 'nothing more'}: XLA compile {compile_s:.1f} s, "
            f"{secs * 1e3:.1f} ms a step, MFU {mfu_text(cfg, secs)}, temporaries "
            f"{other.memory_analysis().temp_size_in_bytes / 2**30:.1f} GiB, losses "
            f"{[round(x, 4) for x in other_losses]}", flush=True)
      del other
    if prog_b is not None:
      state = time_ab(prog_b, prog, step, state, batch)
  return step, median_s, losses


def tokens_per_device_s(cfg, step_time: float) -> float:
  """Tokens a second on each of the step's --devices devices."""
  return cfg.train.global_batch * cfg.train.seq_len / step_time / _DEVICES.value


def mfu_text(cfg, step_time: float) -> str:
  """The step's MFU on this device ("n/a" where its peak is unknown)."""
  peak = flops.peak_flops(jax.devices()[0])
  fpt = flops.flops_per_token(cfg.model, cfg.train.seq_len)["train"]
  return f"{flops.mfu(tokens_per_device_s(cfg, step_time), fpt, peak):.1%}" if peak else "n/a"


def print_tables(cfg, dev, step, step_time, loss, opt_times):
  """The train step's row (time, tokens/s, MFU, memory) and the optimizer steps' shares."""
  # The allocator's peak over the whole script (the optimizer steps above peak lower).
  peak_gib = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
  temp_gib = step.memory_analysis().temp_size_in_bytes / 2**30
  print(f"\n| train step ({cfg.optimizer.name}) | {step_time * 1e3:.1f} ms | "
        f"{tokens_per_device_s(cfg, step_time):,.0f} tok/s per device | "
        f"MFU {mfu_text(cfg, step_time)} | loss {loss:.3f} | "
        f"peak {peak_gib:.1f} GiB, temporaries {temp_gib:.1f} GiB | "
        f"KDA {cfg.model.kda.backend} |", flush=True)
  print("\n| optimizer step | time | share of the train step |\n|---|---|---|")
  for variant, secs in opt_times.items():
    print(f"| {variant} | {secs * 1e3:.2f} ms | {secs / step_time:.1%} |", flush=True)


def main(argv):
  del argv
  if _SHARERS.value > 1 and (_VARIANTS.value or _NS_BLOCKS.value):
    raise app.UsageError("--sharers times the train step only: add --variants= --nons_blocks")
  if _SHARERS.value > 1 and not _SHARE_DIR.value:
    raise app.UsageError("--sharers needs --share_dir: a new directory, the same for all")
  cfg = k3config.validate(cli.CONFIG.value)
  for spec in _COMPILE_WITH.value:  # a malformed set fails now, not after the compile
    k3config.xla_options(spec, "any")
  cfg_b = ab_config() if _AB.value else None  # an --ab typo too
  t = cfg.train
  memory.claim_gpu_share(t.gpu_memory_fraction)  # before `header` starts JAX
  print(header(f"{cfg.model.num_layers} layers, d {cfg.model.d_model}",
               f"batch {t.global_batch} x {t.seq_len}"), flush=True)

  # The program k3jax.train runs (donating its state), on a mesh over --devices devices.
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:_DEVICES.value]))
  prog_b = ab_program(cfg_b, prog) if cfg_b is not None else None
  abs_params = prog.abstract_params
  batch = first_batch(cfg)

  # The optimizer steps first: they compile in seconds, the train step in minutes. Their
  # parameters are drawn only when timed: a state drawn and dropped leaves the allocator's
  # pool in pieces, where the step's temporaries need one buffer of tens of GiB.
  opt_times = {}
  if _VARIANTS.value:
    with prog.rules():
      params = prog.fresh_state()[0]
    opt_times = time_optimizer_steps(cfg, abs_params, params)
    del params
  if _NS_BLOCKS.value:
    ns_blocks(cfg, abs_params)
  if not _TRAIN_STEP.value:
    return

  print(f"# optimizer: {optim.describe(cfg, abs_params)}", flush=True)
  print(f"# mesh {dict(prog.mesh.shape)}, MoE dispatch {cfg.model.moe.dispatch}, "
        f"cast_params_once {t.cast_params_once}", flush=True)
  batch = jax.device_put(batch, prog.batch_shardings)
  step, step_time, losses = time_train_step(cfg, prog, batch, prog_b)
  print(f"# losses (the same batch, step after step): {[round(x, 5) for x in losses]}")
  print_tables(cfg, jax.devices()[0], step, step_time, losses[-1], opt_times)


def main_or_mark_failed(argv):
  """main; with --sharers, a failure leaves a mark so the other sharers stop waiting."""
  try:
    main(argv)
  except BaseException:
    if _SHARERS.value > 1 and _SHARE_DIR.value:
      mark_sharer("failed")
    raise


if __name__ == "__main__":
  cli.run(main_or_mark_failed)

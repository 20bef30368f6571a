"""Train a K3 model.

  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny
  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/x --config.train.steps=50

Rerunning with the workdir resumes bit-exactly; SIGTERM or Ctrl-C saves after the current step;
non-finite steps are skipped (`train.max_bad_steps`). Multi-process: parallel/distributed.py."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import (checkpoint, cli, flops, memory, metrics, optim, parallel, paths, profile,
                   program, scoring)
from k3jax import config as k3config
from k3jax import data as k3data
from k3jax.model import K3Model
from k3jax.parallel import distributed

_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
flags.mark_flags_as_required(["config", "workdir"])
# Multi-process runs (k3jax.parallel.distributed); unset: the environment or the cluster's.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process' index.")
_LOCAL_DEVICES = flags.DEFINE_list("local_device_ids", None, "Devices this process uses.")
_PROFILE_STEPS = flags.DEFINE_string(
    "profile_steps", None, "N or N,M: trace steps N to M (from 1) into <workdir>/profile "
    "(k3jax/profile.py; benchmarks/gpu_trace.py turns it into time per component)")

def say(msg: str):
  """Announce a set-up phase or a result (process 0 only)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


class Heartbeat:
  """Prints a line when one step (or the first compile) runs long, so a user sees progress."""

  def __init__(self, every: float = 30.0):
    self.every, self.what, self.since = every, None, 0.0
    self._stop = threading.Event()
    threading.Thread(target=self._run, daemon=True).start()

  def start(self, what: str):
    self.what, self.since = what, time.time()

  def done(self):
    self.what = None

  def _run(self):
    while not self._stop.wait(self.every):
      what = self.what
      if what is not None and time.time() - self.since > self.every:
        say(f"  ... {what}: {time.time() - self.since:.0f}s so far")

  def close(self):
    self._stop.set()


class Preemption:
  """SIGTERM or Ctrl-C: checkpoint at the end of the current step and exit; before `arm()`,
  or at a second Ctrl-C, exit at once (a wakeup-fd watcher thread, since handlers wait out
  long XLA calls). Several processes stop after the same step through jax.distributed's
  preemption service."""

  def __init__(self):
    self.signalled, self.armed, self.interrupted, self._previous = False, False, False, None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = (signal.signal(signal.SIGTERM, self._handle),
                        signal.signal(signal.SIGINT, self._handle))
      self._socks = socket.socketpair()
      self._socks[1].setblocking(False)
      self._old_wakeup = signal.set_wakeup_fd(self._socks[1].fileno(),
                                              warn_on_full_buffer=False)
      threading.Thread(target=self._watch, daemon=True).start()

  def _handle(self, signum, frame):
    del signum, frame
    self.signalled = True

  def _watch(self):
    while True:
      try:
        got = self._socks[0].recv(64)
      except OSError:
        return
      if not got:
        return
      for signum in (signal.SIGTERM, signal.SIGINT):
        if signum not in got:
          continue
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        if not self.armed:
          print(f"{name} before the first step of this run: nothing new to save; exiting",
                file=sys.stderr, flush=True)
          os._exit(128 + signum)
        if signum == signal.SIGINT and self.interrupted:
          print("Ctrl-C again: exiting without saving", file=sys.stderr, flush=True)
          os._exit(128 + signum)
        if signum == signal.SIGINT:
          self.interrupted = True
          print("Ctrl-C: saving after this step, then exiting (Ctrl-C again: exit now)",
                file=sys.stderr, flush=True)

  def arm(self):
    """From now on SIGTERM waits for the end of the current step (and its checkpoint)."""
    self.armed = True

  def reached(self, step: int, ckpt: checkpoint.Checkpointer) -> bool:
    if jax.process_count() > 1:
      return ckpt.reached_preemption(step)
    return self.signalled

  def close(self):
    if self._previous is not None:
      signal.set_wakeup_fd(self._old_wakeup)
      signal.signal(signal.SIGTERM, self._previous[0])
      signal.signal(signal.SIGINT, self._previous[1])
      self._previous = None
      for sock in self._socks:
        sock.close()


class BadSteps:
  """Counts skipped steps; `limit` in a row raise FloatingPointError naming the newest
  checkpoint. `add` reads each flag a step late so the host never waits; `settle` the rest."""

  def __init__(self, limit: int, ckpt: checkpoint.Checkpointer, skipped: int = 0,
               bad_run: int = 0):
    self.limit, self.ckpt = limit, ckpt
    self.skipped, self.bad_run = skipped, bad_run
    self._pending = []

  def add(self, step: int, flag: jax.Array):
    self._pending.append((step, flag))
    self.settle(keep=1)

  def settle(self, keep: int = 0):
    while len(self._pending) > keep:
      step, flag = self._pending.pop(0)
      if not int(np.asarray(jax.device_get(flag))):
        self.bad_run = 0
        continue
      self.skipped, self.bad_run = self.skipped + 1, self.bad_run + 1
      say(f"step {step}: non-finite loss or gradient, update skipped "
          f"({self.bad_run} in a row, {self.skipped} in all)")
      if self.bad_run >= self.limit:
        raise FloatingPointError(self.stop_message(step))

  def stop_message(self, step: int) -> str:
    self.ckpt.wait()
    good = self.ckpt.latest_step()
    head = (f"step {step}: {self.bad_run} steps in a row with a non-finite loss or gradient "
            f"(config.train.max_bad_steps={self.limit}); stopping. ")
    if good is None:
      return head + "No checkpoint was written before them: start again with other settings."
    return head + (
        f"The last checkpoint, written before them, is step {good} in "
        f"{str(self.ckpt.directory)!r}. Rerun with other settings (e.g. a lower "
        f"--config.optimizer.learning_rate) to resume from it; add "
        f"--config.train.skip_batches={good}:{step - good} to also skip the batches of "
        f"steps {good + 1}-{step}.")

  def progress(self) -> dict:
    return {"skipped": self.skipped, "bad_run": self.bad_run}


def put_batch(batch: dict, shardings: dict[str, NamedSharding]) -> dict:
  """Places this process' rows of the global batch on the mesh (`Program.batch_shardings`)."""
  return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v))
          for k, v in batch.items()}


def train(cfg, workdir: str, *, stop_after: int | None = None,
          profile_steps: tuple[int, int] | None = None):
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint; stop_after: stop (with a
  checkpoint) after that many steps; profile_steps: (N, M) traced."""
  k3config.validate(cfg)
  preemption = Preemption()
  try:
    with profile.names_in_cache_key(profile_steps is not None):
      return _train(cfg, workdir, preemption, stop_after, profile_steps)
  finally:
    preemption.close()


def _train(cfg, workdir, preemption, stop_after, profile_steps):
  t = cfg.train
  tokenizer = make_tokenizer(cfg)
  tasks = eval_tasks(t)
  cache_dir = compilation_cache(workdir) if t.compilation_cache else None
  say(f"k3jax: jax {jax.__version__}, {jax.process_count()} process(es), "
      f"{jax.device_count()} device(s): {jax.devices()[0].device_kind} "
      f"({jax.default_backend()})")
  ckpt = checkpoint.Checkpointer(workdir, keep=t.keep_checkpoints,
                                 keep_every=t.keep_checkpoint_every,
                                 save_every=t.checkpoint_every,
                                 compress=t.checkpoint_compression)
  mesh = parallel.make_mesh(cfg.mesh)
  say("model: building (abstract) ...")
  prog = program.build_once(cfg, mesh)
  describe_program(cfg, prog)
  checkpoint.check_free_space(ckpt.directory, prog.state_bytes)
  # Check the state and the compiled step against HBM before allocating anything.
  _, train_step = memory.preflight(prog, log=say, executable_dir=cache_dir)
  data_iter = iter(k3data.make_dataset(cfg.data, seq_len=t.seq_len, global_batch=t.global_batch,
                                       seed=cfg.seed, process_index=jax.process_index(),
                                       process_count=jax.process_count(),
                                       media=k3data.MediaSpec.from_config(cfg.model.vision)))
  config_json = cfg.to_json()
  step, (params, rest, opt_state), bad = start_state(cfg, prog, ckpt, data_iter, workdir,
                                                     config_json)
  # this run's schedule, whatever the program or checkpoint was built with
  opt_state = optim.with_schedule(opt_state, optim.ScheduleParams.of(cfg))
  skip = k3config.skip_batches(t)
  if skip and skip[0] == step:
    for _ in range(skip[1]):
      next(data_iter)
    say(f"data: skipped the {skip[1]} batches after step {step} (train.skip_batches)")
  describe_run(cfg, tokenizer, step, workdir)

  heartbeat = Heartbeat()
  trace = profile.StepTrace(profile_steps, os.fspath(paths.path(workdir) / "profile"),
                            lambda: program_text(prog, train_step))
  report = Report(cfg, prog, tasks, tokenizer, heartbeat,
                  metrics.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                       resume_step=step),
                  metrics.StepTimer(tokens_per_step=t.global_batch * t.seq_len,
                                    total_steps=t.steps, start_step=step))
  run_t0, run_steps = time.time(), 0
  last = t.steps if stop_after is None else min(t.steps, step + stop_after)
  try:
    while step < last:
      batch = put_batch(next(data_iter), prog.batch_shardings)
      heartbeat.start(f"step {step + 1}" + (" (compiling)" if run_steps == 0 else ""))
      trace.before(step + 1)
      with prog.rules():
        params, rest, opt_state, out = train_step(params, rest, opt_state, batch)
      preemption.arm()   # compiled and under way: a SIGTERM now waits for its checkpoint
      step, run_steps = step + 1, run_steps + 1
      if trace.after(step, out):
        say(f"profile: steps {profile_steps[0]}-{step} traced into {trace.directory}")
      bad.add(step, out["skipped"])
      if step % t.log_every == 0 or step == last:
        bad.settle()
        report.step(step, out, bad.skipped)
      if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
        report.evaluate(step, params, rest)
      preempted = preemption.reached(step, ckpt)
      saved = False
      if step % t.checkpoint_every == 0 or step == last or preempted:
        saved = save_unless_diverging(step, ckpt, bad, report.writer, (params, rest, opt_state),
                                      data_iter, config_json)
      if preempted:
        say(f"preempted: {f'saved step {step}' if saved else 'nothing saved'}; "
            "rerun the same command to continue")
        break
  finally:
    trace.close()
    heartbeat.close()
    ckpt.close()
    report.writer.close()
  say(f"done: step {step}, {run_steps} steps this run in "
      f"{metrics.format_duration(time.time() - run_t0)}")
  return params, rest


def make_tokenizer(cfg):
  """data.tokenizer's tokenizer; ConfigError if it makes ids past model.vocab_size."""
  tokenizer = k3data.make_tokenizer(cfg.data.tokenizer)
  try:
    k3data.check_vocab(tokenizer, cfg.model.vocab_size)
  except ValueError as e:
    raise k3config.ConfigError(str(e)) from None
  return tokenizer


def save_unless_diverging(step: int, ckpt, bad: BadSteps, writer: metrics.MetricWriter, state,
                          data_iter, config_json: str) -> bool:
  """Saves `step` unless it ends a run of skipped updates; True when saved."""
  bad.settle()
  if bad.bad_run:
    say(f"step {step}: no checkpoint during {bad.bad_run} skipped step(s) in a row; "
        f"the last is step {ckpt.latest_step()}")
    return False
  writer.flush()
  ckpt.save(step, state, data_iter.get_state(), config_json, progress=bad.progress(),
            force=True)
  return True


def describe_program(cfg, prog) -> None:
  """The mesh, optimizer and model lines of a run's log."""
  say(f"mesh: {dict(prog.mesh.shape)}; batch sharded as {prog.batch_shardings['inputs'].spec}")
  say(f"optimizer: {optim.describe(cfg, prog.abstract_params)}")
  fpt = flops.flops_per_token(cfg.model, cfg.train.seq_len)["train"]
  say(f"model: {prog.num_params:,} parameters; {fpt / 1e9:.3f} GFLOP/token (train, analytic); "
      f"layers {K3Model.__name__} {cfg.model.num_layers}, d {cfg.model.d_model}, "
      f"compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}")


def describe_run(cfg, tokenizer, step: int, workdir: str) -> None:
  """The data and schedule lines of a run's log."""
  t = cfg.train
  say(f"data: {cfg.data.source} corpus, {tokenizer.describe()}, seq {t.seq_len}, "
      f"global batch {t.global_batch} ({t.global_batch * t.seq_len:,} tokens/step), "
      f"{t.global_batch // jax.process_count()} rows on this process"
      + (f", {t.microbatches} microbatches" if t.microbatches > 1 else ""))
  if cfg.data.images.source != "none":
    v = cfg.model.vision
    say(f"data: {cfg.data.images.source} image-text examples, weight {cfg.data.images.weight}; "
        f"per row one packed buffer of {v.max_patches} patches / {v.max_media} images")
  say(f"train: steps {step} -> {t.steps}, log every {t.log_every}, eval every {t.eval_every}, "
      f"checkpoint every {t.checkpoint_every}, workdir {workdir}")


def start_state(cfg, prog, ckpt, data_iter, workdir: str, config_json: str):
  """(step, state, BadSteps) from the latest checkpoint, else `train.init_from`, else init."""
  t = cfg.train
  restored = ckpt.restore_latest(prog.abstract_state, config_json=config_json,
                                 must_match=k3config.RESTORE_FIELDS)
  if restored is not None:
    say(f"restore: step {restored.step} from {workdir}")
    if restored.data is None:
      raise ValueError(f"checkpoint {restored.step} in {workdir} holds no data-iterator state")
    data_iter.set_state(restored.data)
    return (restored.step, restored.state,
            BadSteps(t.max_bad_steps, ckpt, **(restored.progress or {})))
  if t.init_from:   # no random parameters made: they would double the peak memory
    _, params, rest = checkpoint.restore_params(
        t.init_from, prog.abstract_state, config_json=config_json,
        must_match=k3config.MODEL_RESTORE_FIELDS, field="config.train.init_from")
    opt_state = jax.jit(prog.tx.init, out_shardings=prog.state_shardings[2])(params)
    say(f"init: parameters from {t.init_from}, fresh optimizer state")
    state = params, rest, opt_state
  else:
    say("init: fresh parameters")
    state = prog.fresh_state()
  return 0, state, BadSteps(t.max_bad_steps, ckpt)


class Report:
  """A run's log lines and metrics at log and eval points."""

  def __init__(self, cfg, prog, tasks, tokenizer, heartbeat: Heartbeat,
               writer: metrics.MetricWriter, timer: metrics.StepTimer):
    self.cfg, self.prog, self.tasks, self.tokenizer = cfg, prog, tasks, tokenizer
    self.heartbeat, self.writer, self.timer = heartbeat, writer, timer
    self.fpt = flops.flops_per_token(cfg.model, cfg.train.seq_len)["train"]
    self.peak = cfg.train.peak_tflops * 1e12 or flops.peak_flops(jax.devices()[0])
    self.schedule = optim.make_schedule(cfg)

  def step(self, step: int, out: dict, skipped: int) -> None:
    """Logs and writes step `step`'s outputs; `skipped`: the running total."""
    scalars = {k: float(np.asarray(v)) for k, v in jax.device_get(out).items()}
    self.heartbeat.done()
    rates = self.timer.update(step)
    scalars["skipped"] = skipped
    scalars.update(tokens_per_sec=rates["tokens_per_sec"], lr=float(self.schedule(step - 1)),
                   step_time=rates["step_time"])
    if self.peak:
      scalars["mfu"] = flops.mfu(rates["tokens_per_sec"] / jax.device_count(), self.fpt,
                                 self.peak)
    say(f"step {step:>6}/{self.cfg.train.steps}  loss {scalars['loss']:.4f}  "
        f"grad_norm {scalars['grad_norm']:.3f}  lr {scalars['lr']:.2e}  "
        f"{rates['tokens_per_sec']:,.0f} tok/s  "
        + (f"mfu {scalars['mfu']:.1%}  " if self.peak else "")
        + f"moe max/mean {scalars.get('moe_max_load', float('nan')):.2f}  "
        f"eta {metrics.format_duration(rates['eta_seconds'])}")
    self.writer.write_scalars(step, scalars)

  def evaluate(self, step: int, params, rest) -> None:
    """The held-out loss and eval tasks after `step`, outside the throughput timer."""
    prog = self.prog
    self.heartbeat.start(f"eval at step {step}")
    with prog.rules():
      loss = evaluate(self.cfg, prog.eval_step, params, rest, prog.batch_shardings)
    self.heartbeat.done()
    say(f"eval  {step:>6}  held-out loss {loss:.4f}")
    scores = {"eval_loss": loss}
    if self.tasks is not None:
      self.heartbeat.start(f"eval tasks at step {step}")
      with prog.rules():
        scores.update(self.tasks(nnx.merge(prog.graphdef, params, rest), self.tokenizer))
      self.heartbeat.done()
      say(f"eval  {step:>6}  " + "  ".join(f"{k.removeprefix('eval_')} {v:.4f}"
                                            for k, v in scores.items() if k != "eval_loss"))
    self.writer.write_scalars(step, scores)
    self.timer.reset(step)


def program_text(prog, train_step) -> str:
  """The HLO text of the compiled train step."""
  if isinstance(train_step, jax.stages.Compiled):
    return train_step.as_text()
  with prog.rules():
    return prog.lower_train_step().compile().as_text()


def compilation_cache(workdir: str) -> str:
  """JAX's compilation cache in <workdir>/compilation_cache unless one is set; says which."""
  path = jax.config.jax_compilation_cache_dir
  if not path:
    path = os.fspath(paths.path(workdir) / "compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
  say(f"compile: cache in {path}")
  return path


def eval_tasks(t):
  """train.eval_text / eval_choices as (model, tokenizer) -> scores; None without."""
  if not (t.eval_text or t.eval_choices):
    return None
  def split(spec):
    return [p.strip() for p in spec.split(",") if p.strip()]
  try:
    tasks = scoring.Tasks(split(t.eval_text), split(t.eval_choices),
                          ("config.train.eval_text", "config.train.eval_choices"))
  except (OSError, ValueError) as e:
    raise k3config.ConfigError(str(e)) from None
  scorer = None

  def run(model, tokenizer) -> dict[str, float]:
    nonlocal scorer
    if scorer is None:
      scorer = scoring.Scorer(model, t.seq_len + 1, t.global_batch // t.microbatches)
    else:
      scorer.load(model)
    return scoring.as_scalars(tasks.run(scorer, tokenizer))
  return run


def evaluate(cfg, eval_step, params, rest, shardings) -> float:
  """Mean loss over `train.eval_batches` batches of the held-out split (the same each time)."""
  t = cfg.train
  ds = k3data.make_dataset(cfg.data, seq_len=t.seq_len, global_batch=t.global_batch,
                           seed=cfg.seed, process_index=jax.process_index(),
                           process_count=jax.process_count(), split="validation",
                           media=k3data.MediaSpec.from_config(cfg.model.vision))
  it = iter(ds)
  losses = [float(eval_step(params, rest, put_batch(next(it), shardings)))
            for _ in range(t.eval_batches)]
  return float(np.mean(losses))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  # before the multi-process runtime, whose start touches JAX's backends
  memory.claim_gpu_share(k3config.validate(cli.CONFIG.value).train.gpu_memory_fraction)
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         _LOCAL_DEVICES.value)
  try:
    profile_steps = profile.parse_steps(_PROFILE_STEPS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:
    train(cli.CONFIG.value, _WORKDIR.value, profile_steps=profile_steps)
  except FloatingPointError as e:
    print(f"stopped: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)

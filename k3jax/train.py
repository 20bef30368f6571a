"""Train a K3 model.

  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/k3_tiny
  python -m k3jax.train --config=experiments/k3_tiny.py --workdir=/tmp/x --config.train.steps=50

Rerunning the same command with the same workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import checkpoint, flops, metrics, optim, parallel
from k3jax.steps import make_steps
from k3jax import cli
from k3jax import config as k3config
from k3jax import data as k3data
from k3jax.model import K3Model, axes

_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
flags.mark_flags_as_required(["config", "workdir"])  # config: k3jax.cli

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


def put_batch(batch: dict, sharding: NamedSharding) -> dict:
  """Places this process' rows of the global batch on the mesh."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def train(cfg, workdir: str, *, stop_after: int | None = None):
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint.

  stop_after: end this run after that many steps (with a checkpoint), as a preemption
  would; rerunning continues exactly where it stopped.
  """
  k3config.validate(cfg)
  t = cfg.train
  vocab = k3data.ByteTokenizer.vocab_size
  if vocab > cfg.model.vocab_size:
    raise k3config.ConfigError(f"config.model.vocab_size: {cfg.model.vocab_size} is smaller "
                               f"than the tokenizer's vocabulary ({vocab})")
  say(f"k3jax: jax {jax.__version__}, {jax.process_count()} process(es), "
      f"{jax.device_count()} device(s): {jax.devices()[0].device_kind} "
      f"({jax.default_backend()})")
  ckpt = checkpoint.Checkpointer(workdir, keep=t.keep_checkpoints, save_every=t.checkpoint_every)
  writer = metrics.MetricWriter(workdir, enabled=jax.process_index() == 0)

  mesh = parallel.make_mesh(cfg.mesh)
  batch_sharding = NamedSharding(mesh, parallel.batch_spec())
  data_ways = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  if t.global_batch % data_ways:
    raise k3config.ConfigError(f"config.train.global_batch: {t.global_batch} rows do not split "
                               f"over the {data_ways} data-parallel devices (data x fsdp x expert)")
  say(f"mesh: {dict(mesh.shape)}; batch sharded as {batch_sharding.spec}")

  say("model: building (abstract) ...")
  abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(cfg.seed)))
  graphdef, abs_vars, abs_rest_vars = nnx.split(abstract, nnx.Param, ...)
  parallel.check_divisible(abs_vars, mesh)
  parallel.check_divisible(abs_rest_vars, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(abs_vars))
  tx, schedule = optim.make_optimizer(cfg, abs_vars, mesh=mesh,
                                      param_specs=parallel.param_specs(abs_vars))
  say(f"optimizer: {optim.describe(cfg, abs_vars)}")
  fpt = flops.flops_per_token(cfg.model, t.seq_len)["train"]
  say(f"model: {n_params:,} parameters; {fpt / 1e9:.3f} GFLOP/token (train, analytic); "
      f"layers {K3Model.__name__} {cfg.model.num_layers}, d {cfg.model.d_model}, "
      f"compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}")
  param_sh, opt_sh = parallel.state_shardings(mesh, tx, abs_vars)
  rest_sh = parallel.shardings(mesh, abs_rest_vars)
  state_sh = (param_sh, rest_sh, opt_sh)

  @functools.partial(jax.jit, out_shardings=state_sh)
  def init():  # every array is created where it lives: nothing full-size on one device
    model = K3Model(cfg.model, rngs=nnx.Rngs(cfg.seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    return params, rest, tx.init(params)

  abs_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           jax.eval_shape(init), state_sh)
  ds = k3data.make_dataset(cfg.data, seq_len=t.seq_len, global_batch=t.global_batch,
                           seed=cfg.seed, process_index=jax.process_index(),
                           process_count=jax.process_count())
  data_iter = iter(ds)

  step = ckpt.latest_step()
  if step is None:
    say("init: fresh parameters")
    params, rest, opt_state = init()
    step = 0
  else:
    say(f"restore: step {step} from {workdir}")
    (params, rest, opt_state), data_state = ckpt.restore(step, abs_state)
    if data_state is None:
      raise ValueError(f"checkpoint {step} in {workdir} holds no data-iterator state")
    data_iter.set_state(data_state)
  config_json = cfg.to_json()

  train_step, eval_step = make_steps(graphdef, tx, qk_clip_tau=cfg.optimizer.qk_clip_tau)
  with axes.use_rules(mesh, parallel.RULES):
    train_step = jax.jit(train_step, donate_argnums=(0, 1, 2),
                         out_shardings=(*state_sh, None))
    eval_step = jax.jit(eval_step)

  local_batch = t.global_batch // jax.process_count()
  tokens_per_step = t.global_batch * t.seq_len
  peak = t.peak_tflops * 1e12 or flops.peak_flops(jax.devices()[0])
  say(f"data: {cfg.data.source} corpus, seq {t.seq_len}, global batch {t.global_batch} "
      f"({tokens_per_step:,} tokens/step), {local_batch} rows on this process")
  say(f"train: steps {step} -> {t.steps}, log every {t.log_every}, eval every {t.eval_every}, "
      f"checkpoint every {t.checkpoint_every}, workdir {workdir}")

  heartbeat = Heartbeat()
  window_t0, window_steps, run_t0, run_steps = time.time(), 0, time.time(), 0
  pending = None
  last = t.steps if stop_after is None else min(t.steps, step + stop_after)
  while step < last:
    batch = put_batch(next(data_iter), batch_sharding)
    heartbeat.start(f"step {step + 1}" + (" (compiling)" if run_steps == 0 else ""))
    with axes.use_rules(mesh, parallel.RULES):
      params, rest, opt_state, out = train_step(params, rest, opt_state, batch)
    step += 1
    run_steps += 1
    window_steps += 1
    pending = out
    if step % t.log_every == 0 or step == last:
      out = jax.device_get(pending)
      heartbeat.done()
      dt = time.time() - window_t0
      tok_s = window_steps * tokens_per_step / dt
      scalars = {k: float(np.asarray(v)) for k, v in out.items()}
      scalars.update(tokens_per_sec=tok_s, lr=float(schedule(step - 1)), step_time=dt / window_steps)
      if peak:
        scalars["mfu"] = flops.mfu(tok_s / jax.device_count(), fpt, peak)
      eta = (t.steps - step) * dt / window_steps
      say(f"step {step:>6}/{t.steps}  loss {scalars['loss']:.4f}  "
          f"grad_norm {scalars['grad_norm']:.3f}  lr {scalars['lr']:.2e}  "
          f"{tok_s:,.0f} tok/s  " + (f"mfu {scalars['mfu']:.1%}  " if peak else "")
          + f"moe max/mean {scalars.get('moe_max_load', float('nan')):.2f}  "
          f"eta {metrics.format_duration(eta)}")
      writer.write_scalars(step, scalars)
      window_t0, window_steps = time.time(), 0
    if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
      heartbeat.start(f"eval at step {step}")
      with axes.use_rules(mesh, parallel.RULES):
        loss = evaluate(cfg, eval_step, params, rest, batch_sharding)
      heartbeat.done()
      say(f"eval  {step:>6}  held-out loss {loss:.4f}")
      writer.write_scalars(step, {"eval_loss": loss})
      window_t0 = time.time()
    if step % t.checkpoint_every == 0 or step == last:
      ckpt.save(step, (params, rest, opt_state), data_iter.get_state(), config_json, force=True)
  heartbeat.close()
  ckpt.wait()
  ckpt.close()
  writer.close()
  say(f"done: step {step}, {run_steps} steps this run in "
      f"{metrics.format_duration(time.time() - run_t0)}")
  return params, rest


def evaluate(cfg, eval_step, params, rest, sharding) -> float:
  """Mean loss over `train.eval_batches` batches of the held-out split (the same each time)."""
  t = cfg.train
  ds = k3data.make_dataset(cfg.data, seq_len=t.seq_len, global_batch=t.global_batch,
                           seed=cfg.seed, process_index=jax.process_index(),
                           process_count=jax.process_count(), split="validation")
  it = iter(ds)
  losses = [float(eval_step(params, rest, put_batch(next(it), sharding)))
            for _ in range(t.eval_batches)]
  return float(np.mean(losses))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  train(cli.CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)

"""One train step compiled with each set of XLA options: compile time and step time, side by
side in one process.

  python benchmarks/xla_options.py --config=experiments/k3_small.py \
      --config.train.xla_options= --options="" --options=xla_gpu_enable_triton_gemm=false

The config's step (`k3jax.program.build`, one device, synthetic tokens) is traced and
lowered once; each --options set ("name=value,..."; "" for none) is added to the config's
`train.xla_options` (later wins) and compiled, then runs 2 warm-up and --reps timed steps,
each going on from the last one's state. Prints a markdown table.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from harness import header

from k3jax import cli, flops, parallel, program
from k3jax import config as k3config
from k3jax import data as k3data

_OPTIONS = flags.DEFINE_multi_string("options", [""], "XLA option sets to compare, each "
                                     "\"name=value,...\" as train.xla_options takes them")
_REPS = flags.DEFINE_integer("reps", 4, "timed steps of each (after 2 warm-up steps)")


def main(argv):
  del argv
  cfg = k3config.validate(cli.CONFIG.value)
  if cfg.data.images.source != "none":
    raise app.UsageError("xla_options.py times text steps: a config with data.images has "
                         "benchmarks/train_step.py")
  t = cfg.train
  print(header(f"{cfg.model.num_layers} layers, d {cfg.model.d_model}",
               f"batch {t.global_batch} x {t.seq_len}, {t.microbatches} microbatches"))
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))
  batch = jax.device_put({k: jnp.asarray(v) for k, v in k3data.synthetic_batch(
      t.global_batch, t.seq_len, cfg.model.vocab_size).items()}, prog.batch_shardings)
  platform = jax.devices()[0].platform
  peak = flops.peak_flops(jax.devices()[0])
  per_token = flops.flops_per_token(cfg.model, t.seq_len)["train"]
  with prog.rules():
    state = prog.fresh_state()
    t0 = time.perf_counter()
    lowered = prog.train_step.trace(*state, batch).lower()
    print(f"# traced and lowered once in {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n| XLA options | XLA compile | train step | MFU | temporaries | losses |\n"
          "|---|---|---|---|---|---|")
    for spec in _OPTIONS.value:
      k3config.xla_options(spec, "any")  # a typo is a ConfigError before minutes of compile
      t0 = time.perf_counter()
      step = lowered.compile(compiler_options=k3config.xla_options(spec, platform))
      compile_s = time.perf_counter() - t0
      times, losses = [], []
      for i in range(2 + _REPS.value):
        t0 = time.perf_counter()
        *state, out = step(*state, batch)
        losses.append(round(float(out["loss"]), 4))
        if i >= 2:
          times.append(time.perf_counter() - t0)
      secs = float(np.median(times))
      mfu = (f"{flops.mfu(t.global_batch * t.seq_len / secs, per_token, peak):.1%}" if peak
             else "n/a")
      temp_gib = step.memory_analysis().temp_size_in_bytes / 2**30
      name = spec or "(the config's)"
      print(f"| {name} | {compile_s:.1f} s | {secs * 1e3:.1f} ms | {mfu} | "
            f"{temp_gib:.1f} GiB | {losses} |", flush=True)
      del step


if __name__ == "__main__":
  cli.run(main)

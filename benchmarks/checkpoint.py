"""Checkpoint throughput against the raw disk, and the step-time cost of an async save.

  python benchmarks/checkpoint.py                       # ~2 GiB state under /tmp, CPU
  python benchmarks/checkpoint.py --gib=0.5 --dir=/mnt/disk/x --write   # + results/*.md

Measured in one run, on the same filesystem (everything under --dir, removed at the end):

  raw write   `dd if=/dev/zero bs=1M count=<state size> conv=fdatasync` (data on disk)
  raw read    `dd` of that file after its pages are dropped from the page cache
  save        `k3jax.checkpoint.Checkpointer.save` (sync), until orbax has committed the
              step; then + `sync` until the files are on disk, which is what dd counts
              (with CPU seconds per GiB: on a busy host the CPU, not the disk, limits)
  restore     `Checkpointer.restore` into the state's shardings, cold (the checkpoint's
              pages dropped from the page cache first) and warm (from the page cache)
  async save  a jitted step of fixed cost (a chain of matmuls, ~--step_ms) timed alone,
              then while an async save is in flight; also the time `save` blocks the
              caller (the device-to-host copy) and the save's duration in steps
  checksums   `k3jax.checksums.checksums` of the state (what `save` computes before it
              writes) and of the restored state (what `restore` computes to verify), each
              timed alone in every rep, as a share of that rep's save and cold restore

Each of save, restore and async save runs twice: with orbax's default zstd compression of
every array (`Checkpointer(compress=True)`, the default) and without (`compress=False`).

Pages are dropped with posix_fadvise(DONTNEED) after an fsync, per file: no root, and the
rest of the machine's page cache is left alone. The state is a pytree of float32 arrays
shaped like a model's (per layer two [d, 4d] matrices and small vectors) of random normal
values: zstd shrinks them by ~7% (the exponent bits repeat, the mantissas do not).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from k3jax.checkpoint import Checkpointer  # noqa: E402
from k3jax.checksums import checksums  # noqa: E402

MIB = 2**20


def make_state(gib: float, d: int, seed: int = 0) -> dict:
  """Layers of {"w_in": [d, 4d], "w_out": [4d, d], "norm": [d]} until `gib` GiB, random
  normal float32, on the default device."""
  per_layer = (8 * d * d + d) * 4
  layers = max(1, round(gib * 2**30 / per_layer))
  rng = np.random.default_rng(seed)
  state = {}
  for i in range(layers):
    state[f"layer_{i:02d}"] = {
        "w_in": jnp.asarray(rng.standard_normal((d, 4 * d), np.float32)),
        "w_out": jnp.asarray(rng.standard_normal((4 * d, d), np.float32)),
        "norm": jnp.asarray(1 + 0.1 * rng.standard_normal((d,), np.float32)),
    }
  state["step"] = jnp.int32(0)
  return jax.block_until_ready(state)


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def drop_cache(path: str) -> None:
  """fsync every file under `path` and drop its pages from the page cache."""
  files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs] if os.path.isdir(
      path) else [path]
  for f in files:
    fd = os.open(f, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def dd(args: list[str]) -> tuple[float, str]:
  """(MB/s as dd reports it, dd's summary line)."""
  out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
  line = out.strip().splitlines()[-1]
  m = re.search(r"copied, ([\d.]+) s, ([\d.]+) ([kMG]?B)/s", line)
  secs = float(m.group(1))
  nb = int(line.split()[0])
  return nb / secs / 1e6, line


def uptime() -> str:
  return open("/proc/loadavg").read().split(" ", 3)[:3].__str__()


def make_step(n: int, reps: int):
  """A jitted step of fixed cost: `reps` [n, n] matmuls with a nonlinearity between."""
  w = jnp.asarray(np.random.default_rng(1).standard_normal((n, n), np.float32) / np.sqrt(n))

  @jax.jit
  def step(x):
    for _ in range(reps):
      x = jnp.tanh(x @ w)
    return x

  x = jnp.ones((n, n), jnp.float32)
  return step, x


def time_steps(step, x, count: int) -> list[float]:
  times = []
  for _ in range(count):
    t = time.perf_counter()
    x = step(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return times


def cpu_seconds() -> float:
  """User + system CPU time of this process, all threads (orbax's and tensorstore's)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def sync_reps(args, root, state, abstract, size, name, compress):
  """args.reps sync saves, each restored cold and warm: (save, +sync, cold, warm MB/s,
  CPU-s/GiB of save and restore, checksum (seconds, save or restore seconds), bytes on disk)."""
  gib = size / 2**30
  saves, synced, colds, warms, cpu_save, cpu_restore = [], [], [], [], [], []
  sum_save, sum_restore = [], []   # (checksum seconds, save or restore seconds)
  work = os.path.join(root, "run")
  with Checkpointer(work, keep=1, async_save=False, compress=compress) as ckpt:
    for r in range(args.reps):
      step = r + 1
      t, c = time.perf_counter(), cpu_seconds()
      ckpt.save(step, state, force=True)
      ckpt.wait()
      t_save = time.perf_counter() - t
      cpu_save.append((cpu_seconds() - c) / gib)
      os.sync()
      t_sync = time.perf_counter() - t
      stepdir = os.path.join(work, "checkpoints", str(step))
      on_disk = du(stepdir)
      saves.append(size / t_save / 1e6)
      synced.append(size / t_sync / 1e6)
      t = time.perf_counter()
      want = checksums(state)
      sum_save.append((time.perf_counter() - t, t_save))
      drop_cache(stepdir)
      t, c = time.perf_counter(), cpu_seconds()
      got, _ = ckpt.restore(step, abstract)
      jax.block_until_ready(got)
      t_cold = time.perf_counter() - t
      colds.append(size / t_cold / 1e6)
      cpu_restore.append((cpu_seconds() - c) / gib)
      t = time.perf_counter()
      assert checksums(got) == want
      sum_restore.append((time.perf_counter() - t, t_cold))
      del got
      t = time.perf_counter()
      got, _ = ckpt.restore(step, abstract)
      jax.block_until_ready(got)
      warms.append(size / (time.perf_counter() - t) / 1e6)
      if r == 0:
        np.testing.assert_array_equal(np.asarray(got["layer_00"]["w_in"]),
                                      np.asarray(state["layer_00"]["w_in"]))
      del got
      print(f"{name} rep {r}: save {saves[-1]:.0f} MB/s, +sync {synced[-1]:.0f} MB/s, "
            f"restore cold {colds[-1]:.0f} MB/s, warm {warms[-1]:.0f} MB/s; checksums "
            f"{sum_save[-1][0] * 1e3:.0f} ms ({sum_save[-1][0] / sum_save[-1][1]:.1%} of the "
            f"save), {sum_restore[-1][0] * 1e3:.0f} ms "
            f"({sum_restore[-1][0] / sum_restore[-1][1]:.1%} of the cold restore); "
            f"{on_disk / 2**30:.2f} GiB on disk; loadavg {uptime()}", flush=True)
  shutil.rmtree(work)
  return saves, synced, colds, warms, cpu_save, cpu_restore, sum_save, sum_restore, on_disk


def async_rounds(root, state, step_fn, x, name, compress, rounds):
  """Steps run while async saves write: (step ms before, after, during; save() blocked s;
  save in flight s)."""
  base_before = time_steps(step_fn, x, 10)
  work = os.path.join(root, "async")
  inflight, blocked, save_secs = [], [], []
  with Checkpointer(work, keep=1, async_save=True, compress=compress) as ckpt:
    for r in range(rounds):
      t0 = time.perf_counter()
      ckpt.save(r + 1, state, force=True)
      blocked.append(time.perf_counter() - t0)
      n = 0
      while ckpt.saving():   # steps while the save's background thread writes
        t = time.perf_counter()
        step_fn(x).block_until_ready()
        inflight.append(time.perf_counter() - t)
        n += 1
      save_secs.append(time.perf_counter() - t0)
      ckpt.wait()
      print(f"{name} async round {r}: save() blocked {blocked[-1] * 1e3:.0f} ms, in flight "
            f"{save_secs[-1]:.1f} s over {n} steps; loadavg {uptime()}", flush=True)
      time_steps(step_fn, x, 3)
  base_after = time_steps(step_fn, x, 10)
  shutil.rmtree(work)
  return base_before, base_after, inflight, blocked, save_secs


def measure(args, root, state, abstract, size, step_fn, x, dd_write, dd_read, name,
            compress):
  """(write rows, read rows, notes) of one storage variant: sync saves, cold and warm
  restores, and the step time with an async save in flight."""
  (saves, synced, colds, warms, cpu_save, cpu_restore, sum_save, sum_restore,
   on_disk) = sync_reps(args, root, state, abstract, size, name, compress)
  rounds = 3
  base_before, base_after, inflight, blocked, save_secs = async_rounds(
      root, state, step_fn, x, name, compress, rounds)
  base = float(np.median(base_before + base_after))
  during = float(np.median(inflight)) if inflight else float("nan")
  overlap = len(inflight) / rounds
  interval = 1000  # config.train.checkpoint_every's default
  amortized = (np.median(blocked) + overlap * (during - base)) / (interval * base)

  def share(pairs, of):   # median checksum time and its median share of the save / restore
    secs = [c for c, _ in pairs]
    return (f"{np.median(secs) * 1e3:.0f} ms ({size / np.median(secs) / 1e9:.1f} GB/s)",
            f"{np.median([c / t for c, t in pairs]):.1%} of the {of}",
            f"every rep: {', '.join(f'{c / t:.1%}' for c, t in pairs)}")

  best = max
  write = [
      (f"save, {name}: until orbax commits", f"{best(saves):,.0f} MB/s",
       f"{best(saves) / dd_write:.0%} of write", f"{np.median(cpu_save):.1f} CPU-s/GiB"),
      (f"save, {name}: + sync", f"{best(synced):,.0f} MB/s",
       f"{best(synced) / dd_write:.0%} of write", f"{on_disk / 2**30:.2f} GiB on disk"),
      (f"checksums at save, {name}", *share(sum_save, "save")),
  ]
  read = [
      (f"restore, {name}: cold page cache", f"{best(colds):,.0f} MB/s",
       f"{best(colds) / dd_read:.0%} of read", f"{np.median(cpu_restore):.1f} CPU-s/GiB"),
      (f"restore, {name}: warm page cache", f"{best(warms):,.0f} MB/s",
       f"{best(warms) / dd_read:.0%} of read", ""),
      (f"checksums at restore, {name}", *share(sum_restore, "cold restore")),
  ]
  notes = [
      f"{name}: async save in flight {np.median(save_secs):.1f} s (median of {rounds}); "
      f"save() blocks the caller {np.median(blocked) * 1e3:.0f} ms; the step takes "
      f"{base * 1e3:.0f} ms alone (before {np.median(base_before) * 1e3:.0f}, after "
      f"{np.median(base_after) * 1e3:.0f}), {during * 1e3:.0f} ms with the save in flight: "
      f"**+{during / base - 1:.0%}** on the {overlap:.0f} steps a save overlaps; amortized "
      f"over checkpoint_every={interval} steps **{amortized:.1%}**",
      f"{name}: every rep (MB/s): save {[round(v) for v in saves]}, + sync "
      f"{[round(v) for v in synced]}, restore cold {[round(v) for v in colds]}, warm "
      f"{[round(v) for v in warms]}",
  ]
  return write, read, notes


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=2.0, help="state size")
  ap.add_argument("--d", type=int, default=2048, help="model width of the state's layers")
  ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk")
  ap.add_argument("--reps", type=int, default=2, help="saves and restores, best taken")
  ap.add_argument("--step_n", type=int, default=1024, help="matmul size of the step")
  ap.add_argument("--step_ms", type=float, default=300.0, help="target step time")
  ap.add_argument("--write", action="store_true", help="write benchmarks/results/checkpoint.md")
  args = ap.parse_args()

  root = tempfile.mkdtemp(prefix="k3jax_ckpt_bench.", dir=args.dir)
  rows, notes, load0 = [], [], uptime()
  print(f"loadavg {load0}; temp dir {root}", flush=True)
  try:
    t = time.perf_counter()
    state = make_state(args.gib, args.d)
    size = nbytes(state)
    print(f"state: {len(jax.tree.leaves(state))} arrays, {size / 2**30:.2f} GiB "
          f"(made in {time.perf_counter() - t:.0f} s)", flush=True)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

    # -- the raw disk, same size, same filesystem --
    raw = os.path.join(root, "dd.bin")
    count = size // MIB
    dd_write, dd_line = dd(["if=/dev/zero", f"of={raw}", "bs=1M", f"count={count}",
                            "conv=fdatasync"])
    drop_cache(raw)
    dd_read, dd_rline = dd([f"if={raw}", "of=/dev/null", "bs=1M"])
    os.remove(raw)
    print(f"dd write: {dd_write:.0f} MB/s  ({dd_line})\ndd read (cold): {dd_read:.0f} MB/s "
          f"({dd_rline})", flush=True)

    step_fn, x = make_step(args.step_n, 1)
    time_steps(step_fn, x, 2)
    one = min(time_steps(step_fn, x, 5))
    step_reps = max(1, round(args.step_ms / 1e3 / one))
    step_fn, x = make_step(args.step_n, step_reps)
    time_steps(step_fn, x, 2)  # compile, warm up

    rows = [("raw write, dd conv=fdatasync", f"{dd_write:,.0f} MB/s", "100% of write", "")]
    rows_read = [("raw read (cold), dd", f"{dd_read:,.0f} MB/s", "100% of read", "")]
    for compress in (True, False):
      name = "zstd (default)" if compress else "compress=False"
      r, rr, n = measure(args, root, state, abstract, size, step_fn, x, dd_write, dd_read,
                         name, compress)
      rows += r
      rows_read += rr
      notes += n
    rows += rows_read
    print("\n".join(f"{a:45s} {b:>12s}  {c:15s} {d}" for a, b, c, d in rows))
    print("\n".join(notes))
    print(f"loadavg at the end {uptime()}")
    notes.append(f"step: {step_reps} x [{args.step_n}]^2 matmul + tanh, jitted; dd write "
                 f"{dd_line!r}; dd read {dd_rline!r}; load average (1, 5, 15 min) at the "
                 f"start {load0}, at the end {uptime()}")
  finally:
    shutil.rmtree(root, ignore_errors=True)

  if args.write:
    write_results(args, size, rows, notes)


def write_results(args, size, rows, notes):
  path = os.path.join(REPO, "benchmarks", "results", "checkpoint.md")
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), platform.processor())
  lines = [
      "# Checkpoint throughput and async-save overhead (`benchmarks/checkpoint.py`)", "",
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu}, "
      f"{os.cpu_count()} cores; JAX {jax.__version__}, orbax-checkpoint {ocp.__version__}; "
      f"state {size / 2**30:.2f} GiB float32 under {args.dir}; "
      f"`python benchmarks/checkpoint.py --gib={args.gib}`", "",
      "| what | throughput | vs dd (same run) | |", "|---|---|---|---|",
      *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows], "",
      *[f"- {n}" for n in notes], ""]
  with open(path, "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()

"""Fault injection: kill -9 a training run at random steps, damage its newest checkpoint,
rerun the same command each time, and compare with an uninterrupted run bit for bit.

  python benchmarks/fault_injection.py --set=optimizer.warmup_steps=5   # k3_tiny, 20 steps, 5 kills
  python benchmarks/fault_injection.py --steps=40 --kills=8 --seed=1 --write   # + results/*.md
  python benchmarks/fault_injection.py --kills=1 --damage=zero,flip   # the damage faults only

Both runs use the same command (`python -m k3jax.train --config=... --workdir=...`); the
interrupted one is killed with SIGKILL after random logged steps, one of the kills while an
async checkpoint save is in flight (the driver waits for orbax's temporary directory to
appear), and rerun until it finishes. Each `--damage` fault adds one more kill, after which
the newest committed checkpoint is damaged before the rerun:

  zero  the data file holding the most array bytes overwritten with zeros, at its size
  flip  8 bytes inverted at random places in the bytes of one random array

and the rerun must find it (its log names the arrays whose checksums differ), move it aside
and resume from the checkpoint before it. Compared: every array of the final train state
(params, optimizer state, Quantile-Balancing biases) by bits, and every logged metric but
the timings, at every step (metrics.jsonl, the last line per step: a rerun repeats the steps
after its checkpoint). Each process start pays jax start-up and a compile; the persistent
compilation cache (--cache_dir) turns the compile into a load after the first run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMINGS = ("wall_time", "tokens_per_sec", "step_time", "mfu")  # differ run to run
_DRIVER_FIELDS = ("--config.train.steps", "--config.train.log_every",
                  "--config.train.checkpoint_every")  # set by the driver itself
_STEP_LINE = re.compile(r"^step\s+(\d+)/\d+\s")


def subprocess_env(cache_dir: str) -> dict:
  """The environment of a training subprocess: this repository importable, CPU, and the
  persistent compilation cache for every program (a restart reloads, not recompiles)."""
  env = dict(os.environ)
  env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             PYTHONUNBUFFERED="1")
  return env


def train_command(config: str, workdir: str, overrides=()) -> list[str]:
  return [sys.executable, "-m", "k3jax.train", f"--config={config}", f"--workdir={workdir}",
          *overrides]


def _save_in_flight(workdir: str) -> list[str]:
  """Orbax's temporary step directories: a save has started and not been committed."""
  try:
    return [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if "-tmp" in n]
  except FileNotFoundError:
    return []


def run(cmd, env, workdir: str, *, kill_after: int | None = None, during_save: bool = False,
        timeout: float = 600.0) -> dict:
  """Runs `cmd`; with `kill_after`, SIGKILLs it once it has logged that step (and, with
  `during_save`, as soon as a checkpoint save is in flight after that). Returns
  {"returncode", "last_step" (the last logged), "killed", "in_flight" (temporary
  directories present at the kill), "seconds", "output"}."""
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=REPO)
  lines = queue.Queue()
  reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
  reader.start()
  out, last, killed, in_flight = [], None, False, []
  while True:
    while not lines.empty():
      line = lines.get()
      out.append(line)
      m = _STEP_LINE.match(line)
      if m:
        last = int(m.group(1))
    if proc.poll() is not None:
      break
    if time.time() - t0 > timeout:
      proc.kill()
      raise TimeoutError(f"{' '.join(cmd)} ran over {timeout:.0f}s:\n" + "".join(out[-30:]))
    if kill_after is not None and last is not None and last >= kill_after:
      in_flight = _save_in_flight(workdir)
      if not during_save or in_flight:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
        break
    time.sleep(0.001 if kill_after is not None and last is not None and last >= kill_after
               else 0.02)
  reader.join(timeout=10)
  while not lines.empty():
    out.append(lines.get())
  for line in out:
    m = _STEP_LINE.match(line)
    if m:
      last = int(m.group(1))
  return {"returncode": proc.returncode, "last_step": last, "killed": killed,
          "in_flight": in_flight, "seconds": time.time() - t0, "output": "".join(out)}


def metrics_by_step(workdir: str) -> dict[int, dict]:
  """metrics.jsonl as {step: metrics}, the last line per step, timings dropped."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      r = json.loads(line)
      rows.setdefault(r["step"], {}).update(
          {k: v for k, v in r.items() if k not in TIMINGS and k != "step"})
  return rows


def load_state(workdir, step: int | None = None) -> dict[str, np.ndarray]:
  """{path: array} of the train state saved at `step` (default: the newest committed)."""
  import jax  # noqa: PLC0415  (only the comparing process needs jax)
  import orbax.checkpoint as ocp  # noqa: PLC0415

  root = os.path.join(os.path.abspath(workdir), "checkpoints")
  if step is None:
    step = max(int(n) for n in os.listdir(root) if n.isdigit())
  path = os.path.join(root, str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def final_state(workdir) -> tuple[int, dict[str, np.ndarray]]:
  """(step, {path: array}) of the newest committed checkpoint."""
  root = os.path.join(os.path.abspath(workdir), "checkpoints")
  step = max(int(n) for n in os.listdir(root) if n.isdigit())
  return step, load_state(workdir, step)


def differences(ref_workdir: str, workdir: str) -> list[str]:
  """Every difference between two finished runs: final-state arrays (by bits, NaN
  included) and logged metrics at every step. Empty: bit for bit equal."""
  diffs = []
  (ref_step, ref), (step, got) = final_state(ref_workdir), final_state(workdir)
  if ref_step != step:
    diffs.append(f"final checkpoint: step {step}, reference {ref_step}")
  for k in sorted(set(ref) | set(got)):
    a, b = ref.get(k), got.get(k)
    if a is None or b is None:
      diffs.append(f"state {k}: only in {'the reference' if b is None else 'the run'}")
    elif a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
      n = int(np.sum(a != b)) if a.shape == b.shape else -1
      diffs.append(f"state {k}: {n} of {a.size} elements differ")
  want, have = metrics_by_step(ref_workdir), metrics_by_step(workdir)
  if sorted(want) != sorted(have):
    diffs.append(f"logged steps differ: missing {sorted(set(want) - set(have))}, "
                 f"extra {sorted(set(have) - set(want))}")
  for s in sorted(set(want) & set(have)):
    for k in sorted(set(want[s]) | set(have[s])):
      if json.dumps(want[s].get(k)) != json.dumps(have[s].get(k)):  # NaN == NaN here
        diffs.append(f"step {s} {k}: {have[s].get(k)!r}, reference {want[s].get(k)!r}")
  return diffs


def damage(step_dir: str, fault: str, rng: random.Random) -> str:
  """Applies `fault` ("zero" or "flip", see the module docstring) to the state of the
  checkpoint in `step_dir`; returns what was done, naming the file."""
  from k3jax import checksums  # noqa: PLC0415  (jax: only when a damage fault is asked for)

  chunks = [(path, *c) for path, cs in sorted(checksums.array_locations(step_dir).items())
            for c in cs if c[1] >= 0]   # not the small arrays inlined in b-tree nodes
  if not chunks:
    raise RuntimeError(f"no array data files found in {step_dir}")
  if fault == "zero":
    sizes = {}
    for _, file, _, length in chunks:
      sizes[file] = sizes.get(file, 0) + length
    file = max(sizes, key=sizes.get)
    path = os.path.join(step_dir, file)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
      f.write(bytes(size))
    return f"{file} zeroed ({size} bytes)"
  if fault == "flip":
    array, file, offset, length = rng.choice(chunks)
    path = os.path.join(step_dir, file)
    with open(path, "r+b") as f:
      for at in sorted(rng.sample(range(offset, offset + length), min(8, length))):
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    return f"8 bytes of {array} inverted in {file}"
  raise ValueError(f"unknown damage fault {fault!r}: zero or flip")


def committed_steps(workdir: str) -> list[int]:
  try:
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                  if n.isdigit())
  except FileNotFoundError:
    return []


# restore_latest's warning: "<n> array(s) differ ...: <path> (<files>); <path> (<files>)): damaged"
_DETECTED = re.compile(r"(\d+) array\(s\) differ from their checksums recorded at save: "
                       r"(.*?)\): damaged")


def kill_steps(steps: int, kills: int, checkpoint_every: int, seed: int) -> list[tuple[int, bool]]:
  """`kills` increasing (step, during_save) targets in [1, steps): random steps, one of them
  a checkpoint step where the kill waits for the save to be in flight."""
  rng = random.Random(seed)
  saves = [s for s in range(checkpoint_every, steps, checkpoint_every)]
  if kills >= steps - 1 or not saves:
    raise ValueError(f"{kills} kills need more than {kills + 1} steps and a checkpoint before "
                     f"the last step (steps={steps}, checkpoint_every={checkpoint_every})")
  at_save = rng.choice(saves)
  others = rng.sample([s for s in range(1, steps) if s != at_save], kills - 1)
  return sorted([(s, False) for s in others] + [(at_save, True)])


def damage_steps(steps: int, faults, checkpoint_every: int, taken, seed: int) -> list[int]:
  """One kill step per damage fault, not in `taken`, late enough that two checkpoints are
  committed (the damaged newest one and one to fall back to)."""
  rng = random.Random(seed + 1)
  free = [s for s in range(2 * checkpoint_every + 2, steps) if s not in taken]
  if len(free) < len(faults):
    raise ValueError(f"{len(faults)} damage faults need {len(faults)} free steps after step "
                     f"{2 * checkpoint_every + 1} (steps={steps})")
  return sorted(rng.sample(free, len(faults)))


def fault_injection(config: str, root: str, *, steps: int, checkpoint_every: int, kills: int,
                    seed: int, env: dict, overrides=(), timeout: float = 600.0,
                    damages=()) -> dict:
  """Runs the reference and the interrupted run under `root`; returns a summary dict.
  `damages`: damage faults ("zero", "flip"), each after a kill of its own."""
  overrides = [*overrides, f"--config.train.steps={steps}", "--config.train.log_every=1",
               f"--config.train.checkpoint_every={checkpoint_every}"]
  ref_dir, dir_ = os.path.join(root, "uninterrupted"), os.path.join(root, "killed")
  ref = run(train_command(config, ref_dir, overrides), env, ref_dir, timeout=timeout)
  if ref["returncode"] != 0:
    raise RuntimeError("the uninterrupted run failed:\n" + ref["output"][-3000:])
  plan = kill_steps(steps, kills, checkpoint_every, seed) if kills else []
  damage_at = dict(zip(damage_steps(steps, damages, checkpoint_every,
                                    {t for t, _ in plan}, seed), damages))
  plan = sorted(plan + [(t, False) for t in damage_at]) + [(None, False)]
  events, rng, damaged = [], random.Random(seed + 2), None   # damaged: (step, what)
  for target, during_save in plan:
    r = run(train_command(config, dir_, overrides), env, dir_, kill_after=target,
            during_save=during_save, timeout=timeout)
    resumed = re.search(r"^restore: step (\d+)", r["output"], re.M)
    detected = _DETECTED.search(r["output"])
    events.append({"target": target, "during_save": during_save, "killed": r["killed"],
                   "damaged": damaged[1] if damaged else None,
                   "detected": (f"{detected.group(1)}: " + re.sub(r" \([^)]*\)", "",
                                                                  detected.group(2))
                                if detected else None),   # how many arrays: their paths
                   "fell_back": bool(damaged) and resumed is not None
                   and int(resumed.group(1)) < damaged[0] and any(
                       n.startswith(f"{damaged[0]}.corrupt")
                       for n in os.listdir(os.path.join(dir_, "checkpoints"))),
                   "resumed_from": int(resumed.group(1)) if resumed else 0,
                   "last_logged": r["last_step"], "in_flight": r["in_flight"],
                   "seconds": round(r["seconds"], 1)})
    damaged = None
    if target is None:
      if r["returncode"] != 0:
        raise RuntimeError("the final rerun failed:\n" + r["output"][-3000:])
    elif not r["killed"]:
      raise RuntimeError(f"the run ended before the kill at step {target} "
                         f"(rc {r['returncode']}):\n" + r["output"][-3000:])
    elif target in damage_at:
      have = committed_steps(dir_)
      if len(have) < 2:
        raise RuntimeError(f"damage after step {target}: {len(have)} committed checkpoint(s)")
      what = damage(os.path.join(dir_, "checkpoints", str(have[-1])), damage_at[target], rng)
      damaged = (have[-1], f"step {have[-1]}: {what}")
  return {"config": config, "overrides": list(overrides), "steps": steps,
          "checkpoint_every": checkpoint_every, "seed": seed, "kills": kills,
          "damages": list(damages), "events": events,
          "reference_seconds": round(ref["seconds"], 1),
          "differences": differences(ref_dir, dir_)}


def environment() -> dict:
  """When and where: UTC time, CPU model and core count, package versions (not imported)."""
  from importlib import metadata  # noqa: PLC0415
  cpu = "unknown CPU"
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
  except (OSError, StopIteration):
    pass
  versions = {}
  for name in ("jax", "orbax-checkpoint", "grain"):
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      versions[name] = "not installed"
  return {"time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "device": f"{cpu}, {os.cpu_count()} cores (x86-64, CPU backend)", "versions": versions}


def undetected(summary: dict) -> list[str]:
  """The damaged checkpoints a rerun did not find, move aside and resume before."""
  return [e["damaged"] for e in summary["events"]
          if e.get("damaged") and not (e["detected"] and e["fell_back"])]


def markdown(summary: dict) -> str:
  """The summary as the table in benchmarks/results/fault_injection.md."""
  rows = ["| run | damaged before this run | found (arrays named) | kill after step "
          "| during a save | resumed from | last logged step | save in flight at the kill "
          "| seconds |", "|---|---|---|---|---|---|---|---|---|"]
  for i, e in enumerate(summary["events"], 1):
    found = "**no**" if e.get("damaged") else "-"
    if e.get("detected") and e.get("fell_back"):
      count, names = e["detected"].split(": ", 1)
      found = (f"{count} array{'s' if count != '1' else ''}: {names.split('; ')[0]}"
               + (", ..." if count != "1" else "") + "; moved aside")
    rows.append(f"| {i} | {e.get('damaged') or '-'} | {found} "
                f"| {e['target'] if e['target'] is not None else '- (to the end)'} "
                f"| {'yes' if e['during_save'] else 'no'} | {e['resumed_from']} "
                f"| {e['last_logged']} | {', '.join(e['in_flight']) or '-'} | {e['seconds']} |")
  diffs = summary["differences"]
  missed = undetected(summary)
  verdict = ("bit for bit equal: final train state (every array) and every logged metric "
             "but timings at every step" if not diffs else
             f"NOT equal, {len(diffs)} differences:\n\n" + "\n".join(f"- {d}" for d in diffs[:50]))
  if missed:
    verdict += "\n\nDamage NOT found by the rerun: " + "; ".join(missed)
  env = summary.get("environment") or environment()
  saves = sum(e["during_save"] and bool(e["in_flight"]) for e in summary["events"])
  damaged = " and damaged checkpoints" if summary.get("damages") else ""
  return (f"# Fault injection: kill -9{damaged} and rerun, against an uninterrupted run\n\n"
          f"{env['time']}; {env['device']}; "
          + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + "; "
          f"`python benchmarks/fault_injection.py "
          f"--config={summary['config']} --steps={summary['steps']} "
          f"--checkpoint_every={summary['checkpoint_every']} "
          f"--kills={summary.get('kills', len(summary['events']) - 1)} --seed={summary['seed']}"
          + (f" --damage={','.join(summary['damages'])}" if summary.get("damages") else "")
          + "".join(f" --set={o.removeprefix('--config.')}" for o in summary["overrides"]
                    if o.split("=")[0] not in _DRIVER_FIELDS)
          + "` on CPU.\n\n"
          f"{len(summary['events']) - 1} kills (SIGKILL), {saves} of them with an async "
          f"checkpoint save in flight"
          + (f", {len(summary['damages'])} of them followed by damage to the newest checkpoint"
             if summary.get("damages") else "") + ". "
          f"Uninterrupted run: {summary['reference_seconds']} s; "
          "interrupted run, all processes: "
          f"{round(sum(e['seconds'] for e in summary['events']), 1)}"
          f" s; whole benchmark: {summary.get('total_seconds', '-')} s.\n\n" + "\n".join(rows)
          + f"\n\nResult: {verdict}\n")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="experiments/k3_tiny.py")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--checkpoint_every", type=int, default=5)
  p.add_argument("--kills", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--damage", default="zero,flip",
                 help="damage faults, each after a kill of its own: zero, flip (or none)")
  p.add_argument("--cache_dir", default=os.path.join(tempfile.gettempdir(),
                                                     "k3jax-fault-injection-cache"))
  p.add_argument("--workdir", default=None, help="default: a new temporary directory")
  p.add_argument("--timeout", type=float, default=3600.0, help="seconds per process")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="config override for both runs, e.g. optimizer.warmup_steps=5")
  p.add_argument("--write", action="store_true", help="write benchmarks/results/fault_injection.md")
  a = p.parse_args()
  root = a.workdir or tempfile.mkdtemp(prefix="k3jax-fault-injection-")
  t0, env = time.time(), environment()
  summary = fault_injection(a.config, root, steps=a.steps, checkpoint_every=a.checkpoint_every,
                            kills=a.kills, seed=a.seed, env=subprocess_env(a.cache_dir),
                            overrides=[f"--config.{x}" for x in a.set], timeout=a.timeout,
                            damages=[d for d in a.damage.split(",") if d not in ("", "none")])
  summary.update(environment=env, total_seconds=round(time.time() - t0, 1))
  print(json.dumps(summary, indent=1))
  text = markdown(summary)
  print(text)
  if a.write:
    with open(os.path.join(REPO, "benchmarks", "results", "fault_injection.md"), "w") as f:
      f.write(text)
  sys.exit(1 if summary["differences"] or undetected(summary) else 0)


if __name__ == "__main__":
  main()

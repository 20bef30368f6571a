"""A sweep file and its runs: flags, configs, DIR/sweep.json, and whether a run finished.

A sweep file (`experiments/sweeps/`) defines `get_sweep(arg=None)` -> {"config":
"path[:variant]", "arms": [(name, overrides), ...], "seeds": [...], optional "overrides"
(every arm) and "groups" ({question: [arms]})}; see docs/sweeps.md."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re

from k3jax import cli, metrics
from k3jax import config as k3config

SWEEP_JSON = "sweep.json"
DONE_JSON = "sweep_done.json"
LOG_NAME = "train.log"
_KEYS = ("config", "arms", "seeds", "overrides", "groups")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class Sweep:
  spec: str                         # the sweep file as given: path[:arg]
  config: str                       # the base config: path[:variant]
  arms: dict[str, dict]             # name -> its own overrides, in the file's order
  seeds: tuple[int, ...]
  overrides: dict
  groups: dict[str, list[str]]


@dataclasses.dataclass(frozen=True)
class Run:
  arm: str
  seed: int
  workdir: str
  args: tuple[str, ...]             # k3jax.train's flags

  @property
  def name(self) -> str:
    return f"{self.arm}/seed{self.seed}"


def _error(spec: str, msg: str):
  raise k3config.ConfigError(f"sweep {spec}: {msg}")


def load_sweep(spec: str) -> Sweep:
  """The sweep that `path[:arg]`'s get_sweep(arg) describes; ConfigError naming the problem."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    _error(spec, f"no such file {path!r}")
  module_spec = importlib.util.spec_from_file_location("k3jax_sweep_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not callable(getattr(module, "get_sweep", None)):
    _error(spec, "defines no get_sweep(arg=None)")
  try:
    d = module.get_sweep(arg) if arg else module.get_sweep()
  except ValueError as e:
    _error(spec, str(e))
  if not isinstance(d, dict):
    _error(spec, f"get_sweep returned a {type(d).__name__}, not a dict")
  if set(d) - set(_KEYS):
    _error(spec, f"get_sweep returned unknown keys {sorted(set(d) - set(_KEYS))} (known: "
           f"{', '.join(_KEYS)})")
  if not isinstance(d.get("config"), str) or not d["config"]:
    _error(spec, "no 'config' (the base config, e.g. 'experiments/k3_tiny.py')")
  named = _checked_arms(spec, d.get("arms"))
  seeds = d.get("seeds")
  if (not isinstance(seeds, (list, tuple)) or not seeds
      or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
      or len(set(seeds)) < len(seeds)):
    _error(spec, f"'seeds' must be a non-empty list of distinct ints, got {seeds!r}")
  groups = d.get("groups") or {}
  for group, members in groups.items():
    unknown = [a for a in members if a not in named]
    if unknown:
      _error(spec, f"group {group!r} names arms that are not defined: {unknown}")
  return Sweep(spec, d["config"], named, tuple(seeds),
               _checked_overrides(spec, "'overrides'", d.get("overrides") or {}),
               {g: list(m) for g, m in groups.items()})


def _checked_arms(spec: str, arms) -> dict[str, dict]:
  if isinstance(arms, dict):
    _error(spec, "'arms' must be a list of (name, overrides) pairs: a dict would keep only "
           "the last of two arms with one name")
  if not arms:
    _error(spec, "no arms")
  named = {}
  for arm in arms:
    if not (isinstance(arm, (tuple, list)) and len(arm) == 2 and isinstance(arm[1], dict)):
      _error(spec, f"arm {arm!r} is not a (name, overrides) pair")
    name, overrides = arm
    if not isinstance(name, str) or not _NAME.fullmatch(name):
      _error(spec, f"arm name {name!r}: use letters, digits, '_', '.', '-' (a directory name)")
    if name in named:
      _error(spec, f"two arms are named {name!r}")
    named[name] = _checked_overrides(spec, f"arm {name!r}", overrides)
  return named


def _checked_overrides(spec: str, where: str, overrides: dict) -> dict:
  for key, value in overrides.items():
    if key == "seed":
      _error(spec, f"{where} sets 'seed': the seeds come from 'seeds'")
    if not isinstance(key, str) or not isinstance(value, (bool, int, float, str)):
      _error(spec, f"{where}: {key!r}: {value!r} is not a number, bool or string")
  return dict(overrides)


def _flag(key: str, value) -> str:
  return f"--config.{key}={value}"


def plan(sweep: Sweep, workdir: str) -> list[Run]:
  """Every run, seed-major, with its k3jax.train flags."""
  workdir, runs = os.path.normpath(workdir), []
  for seed in sweep.seeds:
    for arm, own in sweep.arms.items():
      run_dir = os.path.join(workdir, arm, f"seed{seed}")
      overrides = {**sweep.overrides, **own, "seed": seed}
      args = (f"--config={sweep.config}", f"--workdir={run_dir}",
              *(_flag(k, v) for k, v in overrides.items()))
      runs.append(Run(arm, seed, run_dir, args))
  return runs


def run_config(run: Run):
  """The validated config `run`'s flags give k3jax.train; ConfigError naming the arm."""
  try:
    return cli.config_from_args(["k3jax.train", *_settings(run.args)])
  except k3config.ConfigError as e:
    raise k3config.ConfigError(f"arm {run.arm!r}: {e}") from None


def write_record(sweep: Sweep, runs: list[Run], workdir: str) -> dict:
  """DIR/sweep.json: what k3jax.report reads (arms, their overrides and configs, runs)."""
  configs = {}
  for run in runs:
    if run.arm not in configs:
      configs[run.arm] = json.loads(run_config(run).to_json())
  record = {
      "sweep": sweep.spec, "config": sweep.config, "seeds": list(sweep.seeds),
      "overrides": sweep.overrides, "groups": sweep.groups,
      "arms": {a: {"overrides": o, "config": configs[a]} for a, o in sweep.arms.items()},
      "runs": [{"arm": r.arm, "seed": r.seed, "dir": f"{r.arm}/seed{r.seed}",
                "args": list(r.args)} for r in runs],
  }
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, SWEEP_JSON + ".tmp")
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, os.path.join(workdir, SWEEP_JSON))
  return record


def _settings(args) -> list[str]:
  return [a for a in args if not a.startswith("--workdir=")]


def last_step(run: Run) -> int:
  """The last step `run` logged training metrics for (0: none yet)."""
  path = os.path.join(run.workdir, metrics.JSONL_NAME)
  records = metrics.read_jsonl(path) if os.path.exists(path) else []
  return max((r["step"] for r in records if "loss" in r), default=0)


def mark_finished(run: Run):
  """<run>/sweep_done.json: `run` exited 0 with these flags."""
  with open(os.path.join(run.workdir, DONE_JSON), "w") as f:
    json.dump({"args": _settings(run.args)}, f)


def finished(run: Run) -> bool:
  """Whether `run` exited 0 with the flags it has now."""
  try:
    with open(os.path.join(run.workdir, DONE_JSON)) as f:
      return json.load(f)["args"] == _settings(run.args)
  except (OSError, ValueError, KeyError):
    return False

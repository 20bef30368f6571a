"""A sweep's report: DIR/report.md with a table and PNG figures, from its runs' metrics.jsonl.

  python -m k3jax.report --workdir=/tmp/oq        # after (or during) python -m k3jax.sweep"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from k3jax import metrics  # noqa: E402
from k3jax import params as k3params  # noqa: E402
from k3jax.sweep_spec import SWEEP_JSON  # noqa: E402

REPORT_NAME = "report.md"
LOAD_KEY = "moe_mean_max_load"


@dataclasses.dataclass
class Arm:
  """One arm's runs: per seed its training records (with "loss") and eval records."""
  name: str
  overrides: dict
  steps: int
  tokens_per_step: int
  train: dict[int, list[dict]]
  evals: dict[int, list[dict]]

  def final_evals(self) -> list[float]:
    """Each finished seed's held-out loss at the last step."""
    return [r["eval_loss"] for recs in self.evals.values() for r in recs
            if r["step"] == self.steps and "eval_loss" in r]

  def median(self, key: str, tail: float = 1.0) -> float:
    """The median over seeds and records of `key` (in the last `tail` of the steps)."""
    vals = [r[key] for recs in self.train.values() for r in recs
            if key in r and r["step"] > (1 - tail) * self.steps]
    return float(np.median(vals)) if vals else float("nan")

  def curve(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) of `key` over the seeds that logged each step."""
    source = self.evals if key == "eval_loss" else self.train
    by_step: dict[int, list[float]] = {}
    for recs in source.values():
      for r in recs:
        if key in r:
          by_step.setdefault(r["step"], []).append(r[key])
    steps = np.array(sorted(by_step))
    vals = [np.array(by_step[s]) for s in steps]
    return (steps, np.array([v.mean() for v in vals]), np.array([v.min() for v in vals]),
            np.array([v.max() for v in vals]))


def load(workdir: str) -> tuple[dict, dict[str, Arm]]:
  """(DIR/sweep.json, every arm's runs) of the sweep in `workdir`."""
  path = os.path.join(workdir, SWEEP_JSON)
  if not os.path.exists(path):
    sys.exit(f"report: no {path}: written by python -m k3jax.sweep --workdir={workdir}")
  with open(path) as f:
    record = json.load(f)
  arms = {}
  for name, a in record["arms"].items():
    t = a["config"]["train"]
    arms[name] = Arm(name, a["overrides"], t["steps"], t["seq_len"] * t["global_batch"], {}, {})
  for run in record["runs"]:
    path = os.path.join(workdir, run["dir"], metrics.JSONL_NAME)
    recs = metrics.read_jsonl(path) if os.path.exists(path) else []
    arm = arms[run["arm"]]
    arm.train[run["seed"]] = [r for r in recs if "loss" in r]
    arm.evals[run["seed"]] = [r for r in recs if "eval_loss" in r]
  return record, arms


def groups_of(record: dict) -> dict[str, list[str]]:
  """The sweep's groups, and the arms in none of them as one more ("all arms" without any)."""
  groups = dict(record["groups"])
  rest = [a for a in record["arms"] if not any(a in g for g in groups.values())]
  if rest:
    groups["other arms" if groups else "all arms"] = rest
  return groups


def parameters(record: dict) -> dict[str, tuple[int, int]]:
  """arm -> (total, active) parameters, nothing allocated."""
  counted, out = {}, {}
  for name, a in record["arms"].items():
    key = json.dumps(a["config"]["model"], sort_keys=True)
    if key not in counted:
      counted[key] = k3params.count(ml_collections.ConfigDict(a["config"]))[1:]
    out[name] = counted[key]
  return out


def _slug(group: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in group)


_LABELS = {"loss": "training loss", "eval_loss": "held-out loss", LOAD_KEY: "expert load max/mean"}


def _plot_curves(ax, arms: list[Arm], key: str, tokens: bool = False):
  for i, arm in enumerate(arms):
    steps, mean, lo, hi = arm.curve(key)
    if not len(steps):
      continue
    x = steps * arm.tokens_per_step if tokens else steps
    ax.plot(x, mean, color=f"C{i % 10}", label=arm.name, lw=1.4)
    ax.fill_between(x, lo, hi, color=f"C{i % 10}", alpha=0.2, lw=0)
  ax.set_xlabel("tokens" if tokens else "step")
  ax.set_ylabel(_LABELS[key])
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)


def figure_curves(arms: list[Arm], title: str, path: str):
  """2 x 2: training and held-out loss against steps and tokens."""
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
  for row, key in enumerate(("loss", "eval_loss")):
    for col, tokens in enumerate((False, True)):
      _plot_curves(axes[row, col], arms, key, tokens)
  fig.suptitle(f"{title}: mean over seeds, band = their range")
  fig.savefig(path, dpi=90)
  plt.close(fig)


def figure_final(groups: dict[str, list[Arm]], path: str):
  """Each group's arms: every seed's held-out loss at the last step, mean ± std."""
  sizes = [len(a) for a in groups.values()]
  fig, axes = plt.subplots(len(groups), 1, figsize=(8, 0.45 * sum(sizes) + 1.2 * len(groups)),
                           gridspec_kw={"height_ratios": sizes}, constrained_layout=True,
                           squeeze=False)
  for ax, (group, arms) in zip(axes[:, 0], groups.items()):
    for y, arm in enumerate(arms):
      vals = arm.final_evals()
      if vals:
        ax.errorbar(np.mean(vals), y, xerr=np.std(vals, ddof=1) if len(vals) > 1 else 0,
                    fmt="o", color="k", capsize=3)
        ax.plot(vals, [y] * len(vals), "x", color="C0", alpha=0.7)
    ax.set_yticks(range(len(arms)), [a.name for a in arms])
    ax.invert_yaxis()
    ax.set_title(group, fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)
  axes[-1, 0].set_xlabel("held-out loss at the last step (x: seeds; o: mean ± std)")
  fig.savefig(path, dpi=90)
  plt.close(fig)


def figure_cost(arms: list[Arm], counts: dict[str, tuple[int, int]], path: str):
  """Tokens/s and parameters (total, active) per arm."""
  names = [a.name for a in arms]
  y = np.arange(len(names))
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.35 * len(names) + 1.5),
                                 constrained_layout=True, sharey=True)
  ax1.barh(y, [a.median("tokens_per_sec") for a in arms], color="C2")
  ax1.set_xlabel("training tokens/s (median of the logged steps)")
  ax2.barh(y - 0.2, [counts[n][0] / 1e6 for n in names], height=0.4, label="total")
  ax2.barh(y + 0.2, [counts[n][1] / 1e6 for n in names], height=0.4, label="active")
  ax2.set_xlabel("parameters (millions)")
  ax2.legend(fontsize=8, loc="lower right")
  ax1.set_yticks(y, names)
  ax1.invert_yaxis()
  for ax in (ax1, ax2):
    ax.grid(axis="x", alpha=0.3)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def figure_load(groups: dict[str, list[Arm]], path: str):
  """Expert load against steps, one panel per group."""
  fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3 * len(groups)), squeeze=False,
                           constrained_layout=True)
  for ax, (group, arms) in zip(axes[:, 0], groups.items()):
    _plot_curves(ax, arms, LOAD_KEY)
    ax.set_title(group, fontsize=10, loc="left")
  fig.savefig(path, dpi=90)
  plt.close(fig)


def _overrides(overrides: dict) -> str:
  return ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "(the base config)"


def _mean_std(vals: list[float], runs: int) -> str:
  if not vals:
    return f"- (0/{runs})"
  std = f" ± {np.std(vals, ddof=1):.3f}" if len(vals) > 1 else ""
  return f"{np.mean(vals):.3f}{std} ({len(vals)}/{runs})"


def _number(x: float, fmt: str) -> str:
  return "-" if not np.isfinite(x) else format(x, fmt)


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def table(arms: list[Arm], counts: dict[str, tuple[int, int]]) -> list[str]:
  has_load = any(a.curve(LOAD_KEY)[0].size for a in arms)
  head = ["arm", "overrides", "held-out loss (finished)", "tokens/s", "params total / active"]
  lines = ["| " + " | ".join(head + (["expert load max/mean"] if has_load else [])) + " |",
           "|" + "---|" * (len(head) + has_load)]
  for a in arms:
    total, active = counts[a.name]
    cells = [f"**{a.name}**", _overrides(a.overrides),
             _mean_std(a.final_evals(), len(a.train)), _number(a.median("tokens_per_sec"), ",.0f"),
             f"{_count(total)} / {_count(active)}"]
    if has_load:
      cells.append(_number(a.median(LOAD_KEY, tail=0.1), ".2f"))
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def write_report(workdir: str) -> str:
  """Writes DIR/report.md and its figures; returns the report's path."""
  record, arms = load(workdir)
  counts = parameters(record)
  groups = {g: [arms[a] for a in names] for g, names in groups_of(record).items()}
  finished = sum(len(a.final_evals()) for a in arms.values())
  common = record["overrides"]
  lines = [f"# Sweep `{record['sweep']}`", "",
           f"Base config `{record['config']}`" + (f" with {_overrides(common)}" if common else "")
           + f"; seeds {', '.join(map(str, record['seeds']))}; {finished} of "
           f"{len(record['runs'])} runs finished.", ""]
  lines += table(list(arms.values()), counts)
  lines += ["", "Held-out loss at the last step: mean ± std over the finished seeds "
            "(finished / seeds). Tokens/s: the median of the logged steps. Expert load: the "
            "busiest expert over the mean, averaged over MoE layers, median of the last tenth "
            "of the steps.", "", "![final held-out loss](final_eval_loss.png)", ""]
  figure_final(groups, os.path.join(workdir, "final_eval_loss.png"))
  for group, members in groups.items():
    name = f"curves_{_slug(group)}.png"
    figure_curves(members, group, os.path.join(workdir, name))
    lines += [f"## {group}", "", f"![{group}]({name})", ""]
  figure_cost(list(arms.values()), counts, os.path.join(workdir, "cost.png"))
  lines += ["## Throughput and size", "", "![throughput and parameters](cost.png)", ""]
  if any(a.curve(LOAD_KEY)[0].size for a in arms.values()):
    figure_load(groups, os.path.join(workdir, "expert_load.png"))
    lines += ["## Expert load", "", "![expert load](expert_load.png)", ""]
  path = os.path.join(workdir, REPORT_NAME)
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path


def main(argv):
  del argv
  print(f"report: {write_report(flags.FLAGS.workdir)}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The sweep's directory (python -m k3jax.sweep).")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)

"""What a compiled GPU program launches per step, read from its HLO text: each launch (a
fusion, a library or kernel call, a copy) by model component (`gpu_trace.component`), how
many times a step runs it (the trip counts of the loops around it), and the bytes an
elementwise launch reads and writes: a floor on its time at the GPU's bandwidth. No GPU
needed; `gpu_compile.py` prints the tables. `costs` also gives a cuBLAS matmul's FLOPs (for
`gpu_trace.py`'s rates); other kernels are counted, not costed."""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

import gpu_trace

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_LAUNCHES = ("fusion", "custom-call", "copy", "transpose", "convert", "reduce", "concatenate",
             "pad", "broadcast", "dynamic-slice", "dynamic-update-slice", "all-reduce")


class Launch(NamedTuple):
  component: str
  kind: str        # "fusion", "copy", ..., "matmul" (a GEMM) or a kernel class: triton, ...
  runs: int        # a step's runs of it
  bytes: int       # an elementwise launch's reads + writes, a run (0: a matmul or kernel)


_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")   # an array in a shape: dtype, dims


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape, tuples summed: "(f32[2,3]{1,0}, bf16[4])" -> 32."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES.get(dtype, 0)
             for dtype, dims in _ARRAY.findall(shape))


def _computations(hlo_text: str):
  """({computation: [(name, shape, opcode, operands text, line)]}, the entry's name)."""
  comps, current, entry = {}, None, None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      m = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
      if m:
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
      continue
    m = _INSTRUCTION.match(line) if current else None
    if m:
      comps[current].append((*m.groups(), line))
  return comps, entry


def _runs(comps, entry) -> collections.Counter:
  """How many times a step runs each computation: loop bodies by their known trip counts,
  conditional branches and calls as often as their caller (an upper bound for branches)."""
  runs, order = collections.Counter({entry: 1}), [entry]
  for comp in order:
    for _, _, op, _, line in comps.get(comp, []):
      if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        called = [(re.search(r"body=%?([\w.\-]+)", line).group(1),
                   int(trips.group(1)) if trips else 1)]
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else
                 re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
        called = [(b, 1) for b in names]
      elif op == "call":
        called = [(re.search(r"to_apply=%?([\w.\-]+)", line).group(1), 1)]
      else:
        continue
      for name, trips in called:
        if name not in runs:
          order.append(name)
        runs[name] += runs[comp] * trips
  return runs


class Cost(NamedTuple):
  bytes: int       # an elementwise launch's reads + writes a run (0: a matmul or kernel)
  flops: int       # a cuBLAS matmul's 2 x multiply-adds a run (0: anything else)


def launches(hlo_text: str) -> list[Launch]:
  """Every launch of the compiled program `hlo_text` (`jax.stages.Compiled.as_text()`)."""
  comps, entry = _computations(hlo_text)
  op_names = gpu_trace.parse_hlo(hlo_text).op_names
  step = _runs(comps, entry)
  cost = _costs(comps, step)
  out = []
  for comp, runs in step.items():
    for name, _, op, _, line in comps.get(comp, []):
      if name not in cost:
        continue
      custom = gpu_trace.custom_class(line).split(":")[0]
      if op == "custom-call" or "gemm" in name or "__cublas" in line:
        kind = custom or "matmul"
      else:
        kind = "fusion" if op == "fusion" else op
      component = gpu_trace.component(op_names[name])[0] if name in op_names else "other"
      out.append(Launch(component, kind, runs, cost[name].bytes))
  return out


def costs(hlo_text: str) -> dict[str, Cost]:
  """Each launch instruction's `Cost` a run, by name: what a trace's kernels did per second."""
  comps, entry = _computations(hlo_text)
  return _costs(comps, _runs(comps, entry))


def _costs(comps, step) -> dict[str, Cost]:
  """The launches' costs in the computations a step runs (`_runs`), fusions' insides not."""
  sizes = {name: shape_bytes(shape) for insts in comps.values() for name, shape, *_ in insts}
  dims = {name: _dims(shape) for insts in comps.values() for name, shape, *_ in insts}
  out = {}
  for name, shape, op, operands, line in (i for c in step for i in comps.get(c, [])):
    if op not in _LAUNCHES:
      continue
    args = re.findall(r"%([\w.\-]+)", operands.split("),")[0])
    if op == "custom-call" or "gemm" in name or "__cublas" in line:
      out[name] = Cost(0, _gemm_flops(line, dims[name], dims.get(args[0]) if args else None))
      continue
    reads = [sizes.get(o, 0) for o in args]
    if "dynamic_update_slice" in name or op == "dynamic-update-slice":
      size = 2 * (sum(reads) - max(reads, default=0))   # in place: the update only
    elif "dynamic_slice" in name or op == "dynamic-slice":
      size = 2 * sizes[name]
    else:
      size = sizes[name] + sum(reads)
    out[name] = Cost(size, 0)
  return out


def _dims(shape: str) -> list[int] | None:
  """The first array's dimensions of an HLO shape: "(bf16[8,4]{1,0}, s8[64])" -> [8, 4]."""
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else None


def _gemm_flops(line: str, out: list[int] | None, lhs: list[int] | None) -> int:
  """2 x the output's elements x the contracted size, from a cuBLAS call's dot dimensions."""
  contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
  if "__cublas" not in line or not (contracting and out and lhs):
    return 0
  k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1)))
  return 2 * math.prod(out) * k


def tables(found: list[Launch], bandwidth: float) -> list[str]:
  """Markdown: launches a step per component and kind; elementwise GB a step and the ms
  they take at `bandwidth` bytes/s."""
  kinds = sorted({x.kind for x in found})
  by = collections.defaultdict(collections.Counter)
  moved = collections.Counter()
  for x in found:
    by[x.component][x.kind] += x.runs
    moved[x.component] += x.runs * x.bytes
  rows = ["| component | " + " | ".join(kinds) + " | elementwise GB | ms at "
          f"{bandwidth / 1e12:.1f} TB/s |", "|---|" + "---|" * (len(kinds) + 2)]
  for comp in sorted(by, key=lambda c: -moved[c]):
    rows.append(f"| {comp} | " + " | ".join(str(by[comp][k]) for k in kinds)
                + f" | {moved[comp] / 1e9:.1f} | {moved[comp] / bandwidth * 1e3:.1f} |")
  total = sum(moved.values())
  rows.append("| all | " + " | ".join(str(sum(by[c][k] for c in by)) for k in kinds)
              + f" | {total / 1e9:.1f} | {total / bandwidth * 1e3:.1f} |")
  return rows

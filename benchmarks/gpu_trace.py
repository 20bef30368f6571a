"""Where a traced step's GPU time goes: by model component, by kernel kind, the heaviest
kernels.

  python benchmarks/train_step.py --config=... --profile_dir=/tmp/prof
  python -m k3jax.train --config=... --profile_steps=5      # traces into <workdir>/profile
  python benchmarks/gpu_trace.py /tmp/prof
  python benchmarks/gpu_trace.py /tmp/before /tmp/after     # side by side

Reads the Perfetto copy that `jax.profiler.trace(..., create_perfetto_trace=True)` writes
(`**/perfetto_trace.json.gz`, the newest) and takes the kernels on the GPU's stream lines
(on a CPU-only trace: the XLA ops of the host's threads, for tests). Prints markdown tables:

- with the traced program's HLO text beside the trace (`*.hlo.txt` in the directory, which
  both commands above write): kernel time per model component and phase. Each kernel's HLO
  instruction carries the op name JAX built from the named scopes the model sets (kda, mla,
  attn_res, moe: router / dispatch / experts / shared, ffn, embed, lm_head_loss,
  optimizer); the innermost one names the component, and the phase is the forward,
  the backward (`transpose(...)`), the remat recompute (`rematted_computation`) or outside
  the gradient (update: the optimizer, the norms, keeping or skipping the step).
- per kind (by kernel name, `KINDS`, first match), the time, share and count;
- with the HLO: the 25 heaviest (kernel, component, phase, HLO result shape) groups, which
  tell apart one kernel's launches for different ops, each with its rate (the bytes an
  elementwise launch moves or a cuBLAS matmul's FLOPs, `hlo_launches.costs`, per second),
  and one line of the rate of all of them: what is bandwidth-bound and what is slow;
- the 25 heaviest kernels; the span from the first kernel's start to the last one's end
  with the time no kernel ran (idle); that idle time by gap length, and the longest gaps
  with the kernels before and after them.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import sys
from typing import NamedTuple

# kind -> pattern on the lower-cased kernel name; the first that matches names the kind.
KINDS = (
    ("MLA attention (Triton mha)", r"mha"),
    ("MLA attention (cuDNN flash)", r"sdpa|flash_fprop|flash_bprop"),
    ("QK-Clip max logit", r"row_max_kernel|max_logit"),
    ("KDA kernels", r"rec_fwd|rec_bwd|prep_kernel|chunk_cots|chunk_bwd|transition_kernel|"
                    r"chain_kernel"),
    ("short conv kernels", r"grad_p_kernel|grad_x_kernel|_fwd_kernel"),
    ("grouped matmuls (Mosaic GPU)", r"mosaic|persistent|(?<!w)gmm|ragged"),
    ("Newton-Schulz kernels", r"gram_kernel|poly_kernel|apply_kernel|whole_kernel"),
    ("cuBLAS / cuDNN matmuls", r"gemm|nvjet|cublas|cudnn|xmma|cutlass|sm90_|wgmma"),
    ("copies and sets", r"memcpy|memset|copy"),
    ("other XLA kernels", r"."),
)


def load(path: pathlib.Path) -> list[dict]:
  files = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
  if not files:
    raise SystemExit(f"no perfetto_trace.json.gz under {path}")
  with gzip.open(files[-1], "rt") as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


class Kernel(NamedTuple):
  name: str
  start: float     # us
  dur: float       # us
  hlo_op: str      # the HLO instruction or command buffer that launched it ("": unknown)
  op_name: str     # the JAX op name where the trace gives it ("" otherwise)


def gpu_kernels(events: list[dict]) -> list[Kernel]:
  """Every complete event on a GPU process's stream threads (XLA's op and module lines on
  the same process repeat the kernels: skipped). A trace without a GPU process (a CPU run)
  gives the XLA ops its host threads ran instead (events naming an `hlo_op`)."""
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"].get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"].get("name", "")
  gpu = {p for p, n in procs.items() if "GPU" in n or "gpu" in n}

  def kept(e):
    if e.get("ph") != "X":
      return False
    if not gpu:
      return "hlo_op" in e.get("args", {})
    return (e.get("pid") in gpu
            and threads.get((e["pid"], e.get("tid")), "Stream").startswith("Stream"))
  def op_name(args):
    name = args.get("name", "")
    return name if "/" in name else ""
  return [Kernel(e["name"], float(e["ts"]), float(e["dur"]),
                 e.get("args", {}).get("hlo_op", ""), op_name(e.get("args", {})))
          for e in events if kept(e)]


# named scopes the model and the train step set (k3jax/model/k3.py, latent_moe.py,
# moe_dispatch.py, k3jax/steps.py) -> component; the innermost one on an op's name wins.
SCOPES = {"kda": "kda", "mla": "mla", "attn_res": "attn_res", "router": "moe.router",
          "dispatch": "moe.dispatch", "experts": "moe.experts", "shared": "moe.shared",
          "moe": "moe.rest", "ffn": "dense ffn", "embed": "embed",
          "lm_head_loss": "lm_head + loss", "optimizer": "optimizer"}
PHASES = ("forward", "recompute", "backward", "update")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")


# kernel name pattern -> the custom call that launches such kernels (its HLO target, or
# for Triton the kernel's name, which the trace repeats with a "__<n>" suffix)
LIBRARY_KERNELS = (
    (r"nvjet|gemm|cutlass|xmma|cublas|sm90_", "cublas"),
    (r"mosaic", "mosaic_gpu"),
    (r"cudnn|sdpa|fprop|bprop", "cudnn"),
    (r"cub::|radix", "sort"),
)


class Hlo(NamedTuple):
  op_names: dict[str, str]                     # instruction -> JAX op name
  where: dict[str, tuple[str, int]]            # instruction -> (computation, schedule index)
  order: dict[str, list[tuple[str, str]]]      # computation -> [(instruction, class)]
  shapes: dict[str, str]                       # instruction -> result ("bf16[16384,2048]")
  twins: dict[str, tuple[str, ...]]            # instruction -> all compiled as its kernel


class Attribution(NamedTuple):
  op_name: str          # JAX op name, "" when not found
  how: str              # "named", "scheduled", "neighbour" or ""
  instruction: str      # the HLO instruction, "" for "neighbour" and not found


def custom_class(line: str) -> str:
  """A custom call's class from its HLO line: "triton:<kernel>", "cublas", "mosaic_gpu",
  "cudnn", "sort", "custom"; "" for an instruction that is not one."""
  target = re.search(r'custom_call_target="([^"]*)"', line)
  if not target:
    return ""
  target = target.group(1)
  if "triton" in target:
    name = re.search(r', name = "([^"]*)"', line)
    return "triton:" + (name.group(1) if name else "")
  for pattern, cls in (("cublas", "cublas"), ("mosaic", "mosaic_gpu"), ("cudnn", "cudnn"),
                       ("sort", "sort")):
    if pattern in target:
      return cls
  return "custom"


def parse_hlo(hlo_text: str) -> Hlo:
  """The compiled program's instructions: their JAX op names (a fusion without one takes the
  most common op name among the instructions it calls, any other instruction without one,
  such as a copy XLA added, its first operand's), where each sits in its computation's
  schedule, each computation's custom calls in schedule order, and the instructions that
  run as one kernel."""
  names, calls, inside = {}, {}, collections.defaultdict(collections.Counter)
  operands, where, order, shapes = {}, {}, collections.defaultdict(list), {}
  kernel_of = {}   # instruction -> the instruction whose kernel runs it (XLA's dedup)
  computation = None
  for line in hlo_text.splitlines():
    if not line.startswith(" ") and "{" in line:
      m = _COMPUTATION.match(line)
      computation = m.group(1) if m else None
      continue
    inst = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if not inst:
      continue
    name = inst.group(1)
    shape = re.match(r"\(?(\w+\[[\d,]*\])", line[inst.end():])   # a tuple's first element
    if shape:
      shapes[name] = shape.group(1)
    op_name = re.search(r'op_name="([^"]*)"', line)
    dedup = re.search(r'deduplicated_name="([^"]*)"', line)
    kernel_of[name] = dedup.group(1) if dedup else name
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if op_name:
      names[name] = op_name.group(1)
      if computation:
        inside[computation][op_name.group(1)] += 1
    if called:
      calls[name] = called.group(1)
    first = re.search(r"\w\(%?([\w.\-]+)[,)]", line[inst.end():])
    if first:
      operands[name] = first.group(1)
    if computation:
      where[name] = (computation, len(order[computation]))
      order[computation].append((name, custom_class(line)))
  for inst, comp in calls.items():
    if inst not in names and inside[comp]:
      names[inst] = inside[comp].most_common(1)[0][0]
  for inst in operands:
    source, seen = inst, set()
    while source not in names and source in operands and source not in seen:
      seen.add(source)
      source = operands[source]
    if inst not in names and source in names:
      names[inst] = names[source]
  # XLA names the deduplicated fusions; it also reuses the kernel of a single op wrapped
  # as a fusion (wrapped_add...) without saying so: those go by kind and result shape
  named = {v for k, v in kernel_of.items() if v != k}
  groups = collections.defaultdict(list)
  for inst, (comp, _) in where.items():   # in schedule order
    key = kernel_of[inst]
    if key == inst and inst not in named and inst.startswith("wrapped_"):
      key = (comp, re.sub(r"\.\d+$", "", inst), shapes.get(inst))
    groups[key].append(inst)
  twins = {inst: g for g in map(tuple, groups.values()) if len(g) > 1 for inst in g}
  return Hlo(names, where, dict(order), shapes, twins)


def kernel_class(name: str) -> str:
  """The custom-call class (`custom_class`) of a kernel that no instruction is named
  after: a library kernel by its name, a Triton kernel by its name without the suffix."""
  low = name.lower()
  for pattern, cls in LIBRARY_KERNELS:
    if re.search(pattern, low):
      return cls
  return "triton:" + re.sub(r"__\d+$", "", name)


def component(op_name: str) -> tuple[str, str]:
  """(component, phase) of a JAX op name such as
  "jit(step)/transpose(jvp(while))/body/checkpoint/rematted_computation/kda/dot_general"."""
  parts = [re.sub(r"^(?:\w+\()+|\)+$", "", p) for p in op_name.split("/")]
  found = next((SCOPES[p] for p in reversed(parts) if p in SCOPES), "other")
  if "rematted_computation" in parts:
    return found, "recompute"
  if "transpose(" in op_name:
    return found, "backward"
  return found, "forward" if "jvp(" in op_name else "update"


def attribute(kernels: list[Kernel], hlo: Hlo) -> list[Attribution]:
  """Each kernel's `Attribution`: "named" where the kernel names its op or HLO instruction
  (`hlo_op`, or a fusion kernel's own name: fusion_12 is fusion.12); "scheduled" for a
  library or custom kernel inside a command buffer (a CUDA graph runs them and they name
  only the buffer): the first custom call of its kind after the previous located kernel in
  that computation's schedule; "neighbour" where that finds none: the previous kernel's op
  in the same buffer. XLA compiles identical fusions once, under one's name (the others
  carry it as `deduplicated_name`): a kernel so named stands for the next of those
  instructions in turn (`_next_twin`), so the schedule keeps moving forward, and a kernel
  that a CUDA graph ran a little out of the schedule's order stays in its own layer."""
  def own(k):
    return next((n for n in (k.hlo_op, k.name, re.sub(r"_(\d+)$", r".\1", k.name))
                 if n in hlo.op_names), None)
  found = [(hlo.op_names[i], "named", i) if (i := own(k)) else ("", "", None)
           for k in kernels]
  found = [(k.op_name, "named", None) if k.op_name and not f[0] else f
           for k, f in zip(kernels, found)]
  by_buffer = collections.defaultdict(list)
  for i, k in enumerate(kernels):
    by_buffer[k.hlo_op].append(i)
  for members in by_buffer.values():
    members.sort(key=lambda i: kernels[i].start)
    cursor, last_op, turns = None, "", {}
    for i in members:
      op, how, inst = found[i]
      if op:
        if inst in hlo.twins and inst != kernels[i].hlo_op:
          inst = _next_twin(hlo, cursor, inst, turns)
          found[i] = (hlo.op_names.get(inst, op), how, inst)
          op = found[i][0]
        cursor = hlo.where.get(inst, cursor) if inst else cursor
        last_op = op
        continue
      name = _next_scheduled(hlo, cursor, kernel_class(kernels[i].name))
      if name:
        cursor = hlo.where[name]
        found[i] = (hlo.op_names.get(name, ""), "scheduled", name)
        last_op = found[i][0] or last_op
      elif last_op:
        found[i] = (last_op, "neighbour", None)
  return [Attribution(op, how, inst or "") for op, how, inst in found]


def _next_scheduled(hlo: Hlo, cursor, cls: str) -> str | None:
  """The first custom call of class cls after the cursor in its computation, if any."""
  if cursor is None:
    return None
  comp, at = cursor
  order = hlo.order[comp]
  return next((order[j][0] for j in range(at + 1, len(order)) if order[j][1] == cls), None)


def _next_twin(hlo: Hlo, cursor, inst: str, turns: dict) -> str:
  """The instruction whose turn it is to run inst's kernel: the one after the last taken
  of `hlo.twins[inst]` in the cursor's computation, wrapping round to the first."""
  twins = hlo.twins[inst]
  if cursor is not None:
    twins = tuple(t for t in twins if hlo.where[t][0] == cursor[0]) or twins
  turn = (turns.get(twins, -1) + 1) % len(twins)
  turns[twins] = turn
  return twins[turn]


ORDER = tuple(dict.fromkeys([*SCOPES.values(), "other", "unattributed"]))


def _phase_ms(kernels: list[Kernel], hlo: Hlo, attributed: list[Attribution] | None):
  """({(component, phase): kernel ms}, {how attributed: kernel ms})."""
  ms, how_ms = collections.defaultdict(float), collections.Counter()
  for k, (op, how, _) in zip(kernels, attributed or attribute(kernels, hlo)):
    comp, phase = component(op) if op else ("unattributed", "forward")
    ms[comp, phase] += k.dur / 1e3
    how_ms[how or "unattributed"] += k.dur / 1e3
  return ms, how_ms


def component_ms(kernels: list[Kernel], hlo: Hlo) -> dict[str, float]:
  """Kernel ms per component over all phases, then "idle" (no kernel running) and "span"
  (first kernel's start to last one's end)."""
  ms, _ = _phase_ms(kernels, hlo, None)
  out = {c: sum(v for (comp, _), v in ms.items() if comp == c) for c in ORDER}
  busy, span = busy_span(kernels)
  return {**{c: v for c, v in out.items() if v}, "idle": (span - busy) / 1e3,
          "span": span / 1e3}


def kind_ms(kernels: list[Kernel]) -> dict[str, float]:
  """Kernel ms per kind (`KINDS`, by kernel name alone: no attribution involved)."""
  ms = collections.Counter()
  for k in kernels:
    ms[kind(k.name)] += k.dur / 1e3
  return {k: ms[k] for k, _ in KINDS if ms[k]}


def compare_table(before: dict[str, float], after: dict[str, float],
                  names: tuple[str, str] = ("before", "after"),
                  label: str = "component") -> list[str]:
  """Markdown rows: each component's (or kind's) ms in two traced steps (`component_ms`,
  `kind_ms`), side by side with the change; one a step lacks counts 0 there."""
  rows = [f"| {label} | {names[0]} ms | {names[1]} ms | change ms | change |",
          "|---|---|---|---|---|"]
  for comp in dict.fromkeys([*ORDER, *before, *after]):
    b, a = before.get(comp, 0.0), after.get(comp, 0.0)
    if b or a:
      rel = f"{(a - b) / b:+.1%}" if b else "new"
      rows.append(f"| {comp} | {b:.1f} | {a:.1f} | {a - b:+.1f} | {rel} |")
  return rows


def component_table(kernels: list[Kernel], hlo: Hlo,
                    attributed: list[Attribution] | None = None) -> list[str]:
  """Markdown rows: kernel ms per component and phase, the component's share, then idle
  and how the kernels were attributed (`attribute`, unless given)."""
  ms, how_ms = _phase_ms(kernels, hlo, attributed)
  total = sum(ms.values())
  rows = ["| component | forward ms | recompute ms | backward ms | update ms | total ms | share |",
          "|---|---|---|---|---|---|---|"]
  for comp in ORDER:
    cells = [ms.get((comp, ph), 0.0) for ph in PHASES]
    if sum(cells):
      rows.append(f"| {comp} | " + " | ".join(f"{c:.1f}" for c in cells)
                  + f" | {sum(cells):.1f} | {sum(cells) / total:.1%} |")
  busy, span = busy_span(kernels)
  rows.append("| all kernels | " + " | ".join(
      f"{sum(v for (_, ph), v in ms.items() if ph == p):.1f}" for p in PHASES)
      + f" | {total:.1f} | 100% |")
  rows.append(f"| idle (no kernel running) | | | | | {(span - busy) / 1e3:.1f} | "
              f"{(span - busy) / span:.1%} of the span |")
  rows.append("\nkernel time attributed: " + ", ".join(
      f"{how} {v / total:.1%}" for how, v in how_ms.most_common()) + " (`attribute`)")
  return rows


def op_table(kernels: list[Kernel], hlo: Hlo, costs: dict | None = None, top: int = 25,
             attributed: list[Attribution] | None = None) -> list[str]:
  """Markdown rows: the `top` heaviest groups of launches of one kernel for one component,
  phase and HLO result shape (`attribute`). costs (`hlo_launches.costs`): also the rate of
  the launches whose instruction has one: TFLOP/s of a cuBLAS matmul, GB/s of the rest."""
  groups = collections.defaultdict(lambda: [0.0, 0, 0.0, 0, 0])  # us, calls, costed us, B, F
  for k, (op, _, inst) in zip(kernels, attributed or attribute(kernels, hlo)):
    comp, phase = component(op) if op else ("unattributed", "")
    g = groups[k.name, comp, phase, hlo.shapes.get(inst, "")]
    g[0] += k.dur
    g[1] += 1
    cost = (costs or {}).get(inst)
    if cost and (cost.bytes or cost.flops):
      g[2:] = g[2] + k.dur, g[3] + cost.bytes, g[4] + cost.flops
  rows = ["| kernel | component | phase | HLO result | ms | calls | rate |",
          "|---|---|---|---|---|---|---|"]
  for (name, comp, phase, shape), (us, calls, costed, nbytes, flops) in sorted(
      groups.items(), key=lambda kv: -kv[1][0])[:top]:
    rate = (f"{flops / costed / 1e6:.0f} TFLOP/s" if flops else
            f"{nbytes / costed / 1e3:.0f} GB/s" if nbytes else "")
    rows.append(f"| `{name[:60]}` | {comp} | {phase} | {shape} | {us / 1e3:.1f} | {calls} | "
                f"{rate} |")
  return rows


def rates(kernels: list[Kernel], hlo: Hlo, costs: dict,
          attributed: list[Attribution] | None = None) -> str:
  """One line: the time, work and rate of the launches `costs` prices: XLA's elementwise
  launches (GB moved) and cuBLAS's matmuls (TFLOP)."""
  us, work = [0.0, 0.0], [0, 0]
  for k, (_, _, inst) in zip(kernels, attributed or attribute(kernels, hlo)):
    cost = costs.get(inst)
    if cost and (cost.bytes or cost.flops):
      i = 1 if cost.flops else 0
      us[i] += k.dur
      work[i] += cost.flops or cost.bytes
  gb, tflop = work[0] / 1e9, work[1] / 1e12
  return (f"elementwise launches {us[0] / 1e3:.1f} ms, {gb:.1f} GB, "
          f"{gb / max(us[0], 1e-9) * 1e6:.0f} GB/s; cuBLAS matmuls {us[1] / 1e3:.1f} ms, "
          f"{tflop:.1f} TFLOP, {tflop / max(us[1], 1e-9) * 1e6:.0f} TFLOP/s")


# idle gaps by length, us: launch-boundary bubbles, short host waits, long stalls
GAP_BUCKETS = (("under 10", 0.0, 10.0), ("10 to 100", 10.0, 100.0),
               ("100 and more", 100.0, float("inf")))


def idle_gaps(kernels: list[Kernel]) -> list[tuple[float, Kernel, Kernel]]:
  """(us, the kernel that ran last before, the kernel that ends it) for each stretch in
  which no kernel ran, longest first."""
  out, last = [], None
  for k in sorted(kernels, key=lambda k: k.start):
    if last is not None and k.start > last.start + last.dur:
      out.append((k.start - last.start - last.dur, last, k))
    if last is None or k.start + k.dur > last.start + last.dur:
      last = k
  return sorted(out, key=lambda g: -g[0])


def gap_table(kernels: list[Kernel], top: int = 10) -> list[str]:
  """Markdown: idle time by gap length, then the `top` longest gaps with the kernels around
  them (what the GPU waited after, what it waited for)."""
  gaps = idle_gaps(kernels)
  rows = ["| idle gaps, us | gaps | ms |", "|---|---|---|"]
  for label, lo, hi in GAP_BUCKETS:
    part = [g for g, *_ in gaps if lo <= g < hi]
    rows.append(f"| {label} | {len(part)} | {sum(part) / 1e3:.1f} |")
  rows += ["", "| gap us | after | before |", "|---|---|---|"]
  rows += [f"| {g:.0f} | `{a.name[:50]}` ({kind(a.name)}) | `{b.name[:50]}` ({kind(b.name)}) |"
           for g, a, b in gaps[:top]]
  return rows


def busy_span(kernels: list[Kernel]) -> tuple[float, float]:
  """(us some kernel ran: the union of their intervals, streams may overlap; us from the
  first kernel's start to the last one's end)."""
  span = max(k.start + k.dur for k in kernels) - min(k.start for k in kernels)
  return span - sum(g for g, *_ in idle_gaps(kernels)), span


def kind(name: str) -> str:
  low = name.lower()
  return next(k for k, pattern in KINDS if re.search(pattern, low))


def _traced(directory: pathlib.Path) -> tuple[list[Kernel], Hlo]:
  """A trace directory's GPU kernels and its program (the newest `*.hlo.txt`)."""
  kernels = gpu_kernels(load(directory))
  hlo = sorted(directory.rglob("*.hlo.txt"), key=lambda f: f.stat().st_mtime)
  if not kernels or not hlo:
    raise SystemExit(f"{directory}: a comparison needs GPU kernels and the program's HLO")
  return kernels, parse_hlo(hlo[-1].read_text())


def main(argv):
  if len(argv) == 3:  # two traced steps: components, then kinds, side by side
    (kb, hb), (ka, ha) = (_traced(pathlib.Path(d)) for d in argv[1:])
    names = (argv[1], argv[2])
    print("\n".join(compare_table(component_ms(kb, hb), component_ms(ka, ha), names)), "\n")
    print("\n".join(compare_table(kind_ms(kb), kind_ms(ka), names, label="kind")))
    return
  if len(argv) != 2:
    raise SystemExit(__doc__)
  directory = pathlib.Path(argv[1])
  kernels = gpu_kernels(load(directory))
  if not kernels:
    raise SystemExit("the trace has no kernels on a GPU stream line")
  hlo = sorted(directory.rglob("*.hlo.txt"), key=lambda f: f.stat().st_mtime)
  if hlo:
    print(f"kernel time by component ({hlo[-1].name}):\n")
    text = hlo[-1].read_text()
    program = parse_hlo(text)
    import hlo_launches  # noqa: PLC0415  (it reads components from this module)
    costs, attributed = hlo_launches.costs(text), attribute(kernels, program)  # once
    print("\n".join(component_table(kernels, program, attributed)), "\n")
    print("\n".join(op_table(kernels, program, costs, attributed=attributed)), "\n")
    print(rates(kernels, program, costs, attributed), "\n")
  total = sum(k.dur for k in kernels)
  by_kind, by_name = collections.defaultdict(list), collections.defaultdict(list)
  for name, _, dur, *_ in kernels:
    by_kind[kind(name)].append(dur)
    by_name[name].append(dur)
  print("| kind | ms | share of kernel time | kernels |\n|---|---|---|---|")
  for k, _ in KINDS:
    if k in by_kind:
      d = by_kind[k]
      print(f"| {k} | {sum(d) / 1e3:.1f} | {sum(d) / total:.1%} | {len(d)} |")
  print(f"| all kernels | {total / 1e3:.1f} | 100% | {len(kernels)} |")
  print("\n| kernel | kind | ms | calls |\n|---|---|---|---|")
  for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
    print(f"| `{name[:80]}` | {kind(name)} | {sum(d) / 1e3:.1f} | {len(d)} |")
  busy, span = busy_span(kernels)
  print(f"\nspan {span / 1e3:.1f} ms, a kernel running {busy / 1e3:.1f} ms, "
        f"idle {(span - busy) / 1e3:.1f} ms ({(span - busy) / span:.1%})\n")
  print("\n".join(gap_table(kernels)))


if __name__ == "__main__":
  main(sys.argv)

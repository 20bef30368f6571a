"""What a compiled program holds at its memory peak, from an XLA dump.

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
      python benchmarks/train_step.py --config=experiments/k3_small.py:128k --variants= ...
  python benchmarks/xla_memory.py /tmp/dump [--module=REGEX] [--top=40]

Reads the module's `*after_optimizations-live-range.txt` (the buffers live at the heap
simulator's peak) and `*after_optimizations.txt` (each instruction's shape and the JAX
source it came from), and prints the peak's buffers largest first, then their bytes summed
by source line: which lines of the model hold the memory, not only which shapes.
Works on any backend's dump (CPU, GPU, TPU AOT compiles).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes")
_INSTR = re.compile(r"^\s*(?:ROOT )?(%?[\w.\-]+) = (.+?) [\w\-]+\(")
_OP = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)".*?source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


def modules(dump_dir: str, pattern: str | None) -> list[str]:
  """Prefixes (path without the suffix) of the modules in dump_dir with a live-range file."""
  found = []
  for name in sorted(os.listdir(dump_dir)):
    if name.endswith("after_optimizations-live-range.txt"):
      if pattern is None or re.search(pattern, name):
        found.append(os.path.join(dump_dir, name[:-len("-live-range.txt")]))
  return found


def peak_buffers(live_range_file: str) -> list[tuple[str, int]]:
  """[(instruction name, bytes)] of the buffers live at the peak, as the file lists them."""
  out, inside = [], False
  with open(live_range_file) as f:
    for line in f:
      if _PEAK.match(line):
        inside = True
        continue
      if inside:
        m = _LIVE.match(line)
        if not m:
          break
        out.append((m.group(1).lstrip("%"), int(m.group(2))))
  return out


def source_table(hlo_file: str) -> dict[int, str]:
  """stack_frame_id -> "file:line < caller file:line" from the HLO text's frame tables
  (innermost first, three frames at most)."""
  sections = collections.defaultdict(dict)
  section = None
  with open(hlo_file) as f:
    for line in f:
      line = line.rstrip("\n")
      if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        section = line
        continue
      if section is None:
        continue
      m = _TABLE_ROW.match(line)
      if not m:
        if line.startswith(("%", "HloModule", "ENTRY")):
          break
        continue
      sections[section][int(m.group(1))] = m.group(2)
  files = {k: os.path.basename(v.strip('"')) for k, v in sections["FileNames"].items()}

  def field(text, key):
    m = re.search(key + r"=(\d+)", text)
    return int(m.group(1)) if m else 0

  locations = {k: f"{files.get(field(v, 'file_name_id'), '?')}:{field(v, 'line')}"
               for k, v in sections["FileLocations"].items()}
  # a frame's parent is printed one above its id (1 = no parent)
  frames = {k: (locations.get(field(v, "file_location_id"), "?"),
                field(v, "parent_frame_id") - 1) for k, v in sections["StackFrames"].items()}
  out = {}
  for k in frames:
    chain, frame = [], k
    while frame in frames and len(chain) < 3:
      loc, parent = frames[frame]
      chain.append(loc)
      frame = parent if parent != frame else 0
    out[k] = " < ".join(chain)
  return out


def instructions(hlo_file: str) -> dict[str, tuple[str, str, str]]:
  """name -> (shape, JAX op_name, source) for every instruction of the HLO text."""
  frames = source_table(hlo_file)
  table = {}
  with open(hlo_file) as f:
    for line in f:
      m = _INSTR.match(line)
      if not m:
        continue
      op = _OP.search(line)
      src = ""
      if (fid := _FRAME_ID.search(line)):
        src = frames.get(int(fid.group(1)), "")
      elif (old := _SOURCE.search(line)):
        src = f"{os.path.basename(old.group(1))}:{old.group(2)}"
      table[m.group(1).lstrip("%")] = (m.group(2), op.group(1) if op else "", src)
  return table


def short_op(op: str, width: int = 90) -> str:
  """The tail of a JAX op_name path (the innermost transforms and the primitive)."""
  return op if len(op) <= width else "..." + op[-(width - 3):]


def report(prefix: str, top: int) -> str:
  peak = peak_buffers(prefix + "-live-range.txt")
  table = instructions(prefix + ".txt")
  total = sum(b for _, b in peak)
  lines = [f"# {os.path.basename(prefix)}",
           f"live at the peak: {total / 2**30:.2f} GiB in {len(peak)} buffers", "",
           "| GiB | buffer | shape | source | op |", "|---|---|---|---|---|"]
  by_source = collections.Counter()
  for name, size in sorted(peak, key=lambda x: -x[1]):
    shape, op, src = table.get(name, ("?", "", ""))
    by_source[src or name.split(".")[0]] += size
    if len(lines) < top + 5:
      lines.append(f"| {size / 2**30:.3f} | {name} | {shape[:60]} | {src} | {short_op(op)} |")
  lines += ["", "| GiB | source (summed) |", "|---|---|"]
  lines += [f"| {b / 2**30:.3f} | {s} |" for s, b in by_source.most_common(top)]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump_dir")
  parser.add_argument("--module", default=None, help="regex on the dump's file names")
  parser.add_argument("--top", type=int, default=40)
  args = parser.parse_args(argv)
  found = modules(args.dump_dir, args.module)
  if not found:
    sys.exit(f"no *after_optimizations-live-range.txt in {args.dump_dir} "
             f"(dumped with --xla_dump_hlo_as_text?)")
  # the largest module's peak is the one that matters; print each, largest first
  sized = sorted(found, key=lambda p: -sum(b for _, b in peak_buffers(p + "-live-range.txt")))
  for prefix in sized:
    print(report(prefix, args.top), end="\n\n")


if __name__ == "__main__":
  main()

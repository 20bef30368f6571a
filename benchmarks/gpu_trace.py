"""Where a traced step's GPU time goes: kernel time by kind and the heaviest kernels.

  python benchmarks/train_step.py --config=... --profile_dir=/tmp/prof
  python benchmarks/gpu_trace.py /tmp/prof

Reads the Perfetto copy that `jax.profiler.trace(..., create_perfetto_trace=True)` writes
(`**/perfetto_trace.json.gz`, the newest), takes the kernels on the GPU's stream lines and
prints markdown tables: per kind (by kernel name, `KINDS`, first match), the time, share and
count; then the 25 heaviest kernels; and the span from the first kernel's start to the last
one's end with the time no kernel ran (idle).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import sys

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


def gpu_kernels(events: list[dict]) -> list[tuple[str, float, float]]:
  """(name, start us, duration us) of every complete event on a GPU process's stream
  threads (XLA's op and module lines on the same process repeat the kernels: skipped)."""
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"].get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"].get("name", "")
  gpu = {p for p, n in procs.items() if "GPU" in n or "gpu" in n}
  if not gpu:
    raise SystemExit(f"the trace has no GPU process (processes: {sorted(procs.values())})")
  return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
          if e.get("ph") == "X" and e.get("pid") in gpu
          and threads.get((e["pid"], e.get("tid")), "Stream").startswith("Stream")]


def kind(name: str) -> str:
  low = name.lower()
  return next(k for k, pattern in KINDS if re.search(pattern, low))


def main(argv):
  if len(argv) != 2:
    raise SystemExit(__doc__)
  kernels = gpu_kernels(load(pathlib.Path(argv[1])))
  if not kernels:
    raise SystemExit("the trace has no kernels on a GPU stream line")
  total = sum(d for _, _, d in kernels)
  by_kind, by_name = collections.defaultdict(list), collections.defaultdict(list)
  for name, _, dur in kernels:
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
  # busy time: the union of the kernels' intervals (streams may overlap)
  busy, end = 0.0, float("-inf")
  for _, start, dur in sorted(kernels, key=lambda k: k[1]):
    busy += max(0.0, start + dur - max(start, end))
    end = max(end, start + dur)
  span = end - min(s for _, s, _ in kernels)
  print(f"\nspan {span / 1e3:.1f} ms, a kernel running {busy / 1e3:.1f} ms, "
        f"idle {(span - busy) / 1e3:.1f} ms ({(span - busy) / span:.1%})")


if __name__ == "__main__":
  main(sys.argv)

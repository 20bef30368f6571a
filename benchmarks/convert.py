"""Import speed of `k3jax.convert` against the disk's raw read speed, same run, same files.

  python benchmarks/convert.py --dir=/tmp/k3-release --d_model=1024 --experts=64

Writes a release-layout directory of a K3-structured model (9 layers, MXFP4 experts; sizes
from the flags) with the exporter, then: (1) raw read: every shard file read once in 64 MiB
pieces, (2) import: `importer.load_release` onto the local devices, arrays ready. Both read
the same bytes. With --cold (root on Linux) the page cache is dropped before each, so both
read the disk; without it both read whatever the cache holds. Prints GB/s of each, their
ratio, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))

from k3jax import parallel, program  # noqa: E402
from k3jax.convert import exporter, importer, safetensors  # noqa: E402
from k3jax.model.k3 import K3Model  # noqa: E402


def model_config(d: int, experts: int):
  import k3_tiny  # noqa: PLC0415
  c = k3_tiny.get_config()
  m = c.model
  m.d_model, m.ffn.hidden_dim = d, 3 * d
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank = d // 128, 128, 128
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = d // 128, d // 2, d // 4
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = 128, 64, 128
  m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.latent_dim = experts, 8, d, d // 2
  m.moe.shared_dim = d
  return c


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def maybe_drop_cache(cold: bool) -> None:
  """Empty Linux's page cache (root only), so the next reads come from the disk."""
  if cold:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default="/tmp/k3-release")
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--cold", action="store_true",
                      help="drop the page cache before the raw read and the import (root)")
  args = parser.parse_args()
  cfg = model_config(args.d_model, args.experts)
  m = cfg.model
  if not os.path.exists(os.path.join(args.dir, safetensors.INDEX)):
    state = nnx.state(nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    shapes = {importer.param_path(k).removesuffix("/.value"): leaf.shape
              for k, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}

    def param(path, c):
      shape = shapes[path][1:] if c is not None else shapes[path]
      return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    t0 = time.perf_counter()
    exporter.export_release(m, param, args.dir, log=lambda msg: None)
    print(f"# wrote {args.dir} in {time.perf_counter() - t0:.1f} s")
  files = sorted(set(safetensors.read_index(args.dir).values()))
  nbytes = sum(os.path.getsize(f) for f in files)
  rss0 = peak_rss_gib()

  prog = program.build(cfg, parallel.make_mesh(cfg.mesh))
  maybe_drop_cache(args.cold)
  t0 = time.perf_counter()
  for f in files:
    with open(f, "rb", buffering=0) as fh:
      while fh.read(64 * 2**20):
        pass
  raw = time.perf_counter() - t0

  times = []
  for _ in range(2):
    maybe_drop_cache(args.cold)
    t0 = time.perf_counter()
    params, rest = importer.load_release(args.dir, m, prog.abstract_state[:2],
                                         log=lambda msg: None)
    jax.block_until_ready((params, rest))
    times.append(time.perf_counter() - t0)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, rest)))
    del params, rest
  imp, again = times
  print(json.dumps({
      "jax": jax.__version__, "devices": jax.device_count(), "files": len(files),
      "page_cache": "dropped" if args.cold else "as found",
      "file_gib": round(nbytes / 2**30, 3), "param_gib_fp32": round(state_bytes / 2**30, 3),
      "raw_read_gbs": round(nbytes / raw / 1e9, 3), "import_gbs": round(nbytes / imp / 1e9, 3),
      "import_vs_raw": round(raw / imp, 3), "raw_s": round(raw, 2), "import_s": round(imp, 2),
      "compiled_import_gbs": round(nbytes / again / 1e9, 3),
      "compiled_import_vs_raw": round(raw / again, 3), "compiled_import_s": round(again, 2),
      "peak_rss_gib_before_import": round(rss0, 2), "peak_rss_gib": round(peak_rss_gib(), 2)}))


if __name__ == "__main__":
  main()

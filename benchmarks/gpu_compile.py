"""Compile a config's train step for a GPU on a host without one, and say where it goes.

  pip install "jax-cuda12-plugin==<jax's version>" "jax-cuda12-pjrt==<jax's version>"
  python benchmarks/gpu_compile.py --config=experiments/k3_small.py [--config.x.y=...]

XLA:GPU compiles for a described device (`--target`, a GpuTargetConfigProto; default the
H200) with no GPU present: no autotuning (XLA takes its defaults), otherwise the passes and
the LLVM/PTX backend a GPU host runs. Prints the time to trace, lower and compile, the
per-device memory, and a step's launches by model component with the bytes its elementwise
launches move (`hlo_launches.py`): what a step runs, without a GPU.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

# The CUDA plugin checks CUDA's libraries at start; compiling needs none of them.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import harness  # noqa: E402
import hlo_launches  # noqa: E402
from k3jax import cli, parallel, program  # noqa: E402
from k3jax import config as k3config  # noqa: E402

_TARGET = flags.DEFINE_string(
    "target", str(pathlib.Path(__file__).parent / "gpu_targets" / "h200.txtpb"),
    "GpuTargetConfigProto (text) of the GPU to compile for.")
_TOPOLOGY = flags.DEFINE_string("topology", "1x1x1", "partitions x hosts x GPUs a host")
_OUT = flags.DEFINE_string("out", None, "Also write the tables here.")
_HLO = flags.DEFINE_string("hlo", None, "Also write the compiled program's HLO text here.")
_BANDWIDTH = flags.DEFINE_float("bandwidth", 4.8e12, "The GPU's memory bandwidth, bytes/s.")

GIB = 2**30


def gpu_devices(target: str, topology: str) -> list:
  """Compile-only devices of `topology` GPUs described by the text proto at `target`."""
  try:
    desc = topologies.get_topology_desc(platform="cuda", topology=topology,
                                        target_config=pathlib.Path(target).read_text())
  except (NotImplementedError, RuntimeError) as e:
    raise SystemExit(f"no compile-only CUDA topology here ({e}); install jax-cuda12-plugin and "
                     "jax-cuda12-pjrt at jax's version") from e
  return list(desc.devices)


def main(argv):
  del argv
  cfg = k3config.validate(cli.CONFIG.value)
  devices = gpu_devices(_TARGET.value, _TOPOLOGY.value)
  prog = program.build(cfg, parallel.make_mesh(cfg.mesh, devices))
  t0 = time.perf_counter()
  with prog.rules():
    traced = prog.train_step.trace(*prog.abstract_state, prog.abstract_batch())
    t1 = time.perf_counter()
    lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  if _HLO.value:
    pathlib.Path(_HLO.value).write_text(text)
  lines = [harness.header(f"compiled for {devices[0].device_kind} x {len(devices)} on this host"),
           "",
           "| trace | lower | XLA compile | arguments | temporaries | HLO characters |",
           "|---|---|---|---|---|---|",
           f"| {t1 - t0:.1f} s | {t2 - t1:.1f} s | {t3 - t2:.1f} s "
           f"| {mem.argument_size_in_bytes / GIB:.2f} GiB | {mem.temp_size_in_bytes / GIB:.2f} GiB "
           f"| {len(text) / 1e6:.1f}M |",
           "", "A step's launches by component (loops' trip counts applied):", "",
           *hlo_launches.tables(hlo_launches.launches(text), _BANDWIDTH.value)]
  harness.write_table(lines, _OUT.value)


if __name__ == "__main__":
  cli.run(main)

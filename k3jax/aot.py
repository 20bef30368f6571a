"""Compile the train step for a TPU slice from any host, and say whether it fits.

  python -m k3jax.aot --config=experiments/k3_full.py:v5p-2048 --topology=v5:8x8x16 \
      --chip_config=megacore --chips_per_host_bounds=2,2,1
  python -m k3jax.aot --config=experiments/k3_tiny.py --topology=v5p:2x2x1 --num_slices=2 \
      --config.mesh.data=2 --config.mesh.dcn_data=2 --config.mesh.fsdp=4

Lowers `k3jax.program.build`'s step for a libtpu topology (nothing allocated); prints
per-chip HBM, FLOPs and MFU at --step_time; exits 1 if it does not fit. For every term:
LIBTPU_INIT_ARGS="--xla_tpu_impure_oom_fast_exit_threshold=-1 --xla_tpu_no_crash_on_oom=true".
Results: benchmarks/results/aot_k3_full.md."""

from __future__ import annotations

import os
import sys

# A compile-only TPU client: no metadata server, and other processes may load libtpu too.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags  # noqa: E402

from k3jax import cli, parallel, program  # noqa: E402
from k3jax import config as k3config  # noqa: E402
from k3jax.memory import compile_report, preflight  # noqa: E402

_TOPOLOGY = flags.DEFINE_string("topology", None, "libtpu topology name, e.g. v5p:2x2x1.")
_CHIP_CONFIG = flags.DEFINE_string("chip_config", None, "libtpu chip config (e.g. megacore).")
_HOST_BOUNDS = flags.DEFINE_list("chips_per_host_bounds", None, "e.g. 2,2,1")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices of --topology joined by DCN.")
_STEP_TIME = flags.DEFINE_float("step_time", None, "Seconds per step, for the implied MFU.")


def topology_devices(name: str, *, num_slices: int = 1, chip_config: str | None = None,
                     chips_per_host_bounds: tuple[int, ...] | None = None) -> list:
  """Devices of `num_slices` compile-only TPU slices `name`; ValueError if unknown."""
  from jax.experimental import topologies  # noqa: PLC0415
  if num_slices < 1:
    raise ValueError(f"--num_slices: must be >= 1, got {num_slices}")
  kw = {"num_slices": num_slices} if num_slices > 1 else {}
  if chip_config:
    kw["chip_config_name"] = chip_config
  if chips_per_host_bounds:
    kw["chips_per_host_bounds"] = tuple(chips_per_host_bounds)
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kw).devices)
  except Exception as e:  # noqa: BLE001  (libtpu raises several kinds)
    slices = f" x {num_slices} slices" if num_slices > 1 else ""
    raise ValueError(f"--topology={name}{slices}: no such TPU topology here "
                     f"({type(e).__name__}: {e}); is libtpu installed "
                     "(pip install -e '.[test]')?") from e


def main(argv):
  del argv
  if not _TOPOLOGY.value:
    raise app.UsageError("--topology is required (e.g. --topology=v5p:2x2x1)")
  cfg = k3config.validate(cli.CONFIG.value)
  devices = topology_devices(_TOPOLOGY.value, num_slices=_NUM_SLICES.value,
                             chip_config=_CHIP_CONFIG.value,
                             chips_per_host_bounds=tuple(map(int, _HOST_BOUNDS.value or ())))
  mesh = parallel.make_mesh(cfg.mesh, devices)
  across = {a: n for a, n in parallel.slices_along(mesh).items() if n > 1}
  print(f"topology {_TOPOLOGY.value}: {mesh.devices.size} chips"
        + (f" in {_NUM_SLICES.value} slices, over DCN {across}" if across else "")
        + f", mesh {dict(mesh.shape)}", flush=True)
  prog = program.build(cfg, mesh)
  print(f"{cfg.model.num_layers} layers, d {cfg.model.d_model}, {prog.num_params:,} parameters;"
        f" batch {cfg.train.global_batch} x {cfg.train.seq_len}; remat {cfg.model.remat}",
        flush=True)
  try:  # the state from the shardings first: an impossible config is refused before compiling
    report, _ = preflight(prog, log=lambda line: print(line, flush=True),
                          step_time=_STEP_TIME.value)
  except MemoryError as e:
    print(f"DOES NOT FIT: {e}", flush=True)
    sys.exit(1)
  if report is None:
    report, _ = compile_report(prog)
    print("\n".join(report.lines(_STEP_TIME.value)), flush=True)


if __name__ == "__main__":
  cli.run(main)

"""Does a train step fit? Per-chip HBM: capacities, the train state's share, the compiled
step's needs.

`check_state_fits` (shardings alone, no compile), then `compile_report` / `check_fits`
(XLA's memory analysis); `preflight` runs both for `k3jax.train` and `k3jax.aot`.
`claim_gpu_share` sets the allocator's share of a GPU before JAX starts."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax

from k3jax import executables, flops, parallel, program
from k3jax.config_error import ConfigError

GIB = 2 ** 30
# HBM per JAX device, matched in order against device_kind (lowercase); an Ironwood chip
# is two devices.
HBM_BYTES: tuple[tuple[str, int], ...] = (
    ("v5 lite", 16 * GIB),   # v5e
    ("v6 lite", 32 * GIB),   # v6e (Trillium)
    ("tpu7x", 96 * GIB),     # Ironwood, per die
    ("v5", 95 * GIB),        # v5p reports "TPU v5"
    ("v4", 32 * GIB),
    ("h200", 141 * GIB),
    ("h100", 80 * GIB),
)


def hbm_bytes(device) -> int | None:
  """HBM capacity of one device (a `jax.Device` or a device_kind); None if unknown."""
  kind = (device if isinstance(device, str) else device.device_kind).lower()
  return next((size for key, size in HBM_BYTES if key in kind), None)


def allocator_bytes(device) -> int | None:
  """What this process's allocator may hand out on a live `device` (JAX's "bytes_limit": on
  GPUs the share `claim_gpu_share` sets, 75% by default); None where the
  device reports none (CPU, compile-only topologies)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (compile-only devices raise their runtime's error)
    return None
  return (stats or {}).get("bytes_limit")


SHARE_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def claim_gpu_share(fraction: float) -> None:
  """Has JAX's GPU allocator take `fraction` (validated train.gpu_memory_fraction) of each
  GPU's memory; 0 leaves the environment's or JAX's default. JAX reads SHARE_VARIABLE once,
  when its backends start: ConfigError if they have started with another share."""
  if not fraction:
    return
  value, current = f"{fraction:g}", os.environ.get(SHARE_VARIABLE)
  if current == value:
    return
  from jax._src import xla_bridge  # noqa: PLC0415  (no public "have backends started")
  if xla_bridge.backends_are_initialized():
    raise ConfigError(
        f"config.train.gpu_memory_fraction={value}: JAX's backends have already started "
        f"with {SHARE_VARIABLE}={current or 'unset (0.75)'}; set it before anything touches a "
        "device")
  if current is not None:
    print(f"config: train.gpu_memory_fraction={value} replaces {SHARE_VARIABLE}={current}",
          file=sys.stderr, flush=True)
  os.environ[SHARE_VARIABLE] = value


@dataclasses.dataclass(frozen=True)
class Report:
  """Per-chip memory of a compiled train step and its FLOPs."""
  device_kind: str
  chips: int
  mesh: dict
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  capacity_bytes: int | None
  flops_per_chip: float | None
  tokens_per_step: int
  compile_seconds: float
  slices: dict = dataclasses.field(default_factory=dict)  # mesh axis -> slices it spans (> 1)
  loaded: bool = False   # the executable came from `executables`' store, not from XLA
  allocator_bytes: int | None = None  # `allocator_bytes` where below the capacity

  @property
  def total_bytes(self) -> int:
    """Live at the peak: arguments, unaliased outputs, temporaries, code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes)

  @property
  def usable_bytes(self) -> int | None:
    """The capacity, or the allocator's share of it where that is less."""
    return self.allocator_bytes or self.capacity_bytes

  @property
  def fits(self) -> bool | None:
    return None if self.capacity_bytes is None else self.total_bytes <= self.usable_bytes

  def lines(self, step_time: float | None = None) -> list[str]:
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    cap = g(self.capacity_bytes) if self.capacity_bytes else "unknown"
    across = math.prod(self.slices.values())
    dcn = (f" in {across} slices, over DCN {self.slices}" if across > 1 else "")
    out = [f"topology: {self.chips} x {self.device_kind}{dcn}, mesh {self.mesh}",
           f"{'loaded' if self.loaded else 'compiled'} in {self.compile_seconds:.0f} s",
           f"HBM per chip: arguments {g(self.argument_bytes)}, outputs {g(self.output_bytes)}"
           f" (aliased to arguments {g(self.alias_bytes)}), temporaries {g(self.temp_bytes)},"
           f" code {g(self.code_bytes)}",
           f"HBM per chip: total {g(self.total_bytes)} of {cap}"
           + (f" (this process's allocator: {g(self.allocator_bytes)})"
              if self.allocator_bytes else "")]
    if self.flops_per_chip:
      out.append(f"compiled FLOPs per step: {self.flops_per_chip:.4g} per chip, "
                 f"{self.flops_per_chip * self.chips:.4g} in all "
                 f"({self.tokens_per_step:,} tokens)")
      peak = flops.peak_flops(self.device_kind)
      if step_time and peak:
        out.append(f"at {step_time:g} s per step: MFU "
                   f"{self.flops_per_chip / step_time / peak:.1%} of {peak / 1e12:.0f} TFLOP/s")
    out.append("fits" if self.fits else "DOES NOT FIT" if self.fits is False
               else "fit unknown (no HBM size for this device kind)")
    return out


def state_bytes_per_chip(prog: program.Program) -> int:
  """Train-state bytes on the most loaded device, from the shardings alone."""
  per_device = {}
  for x in jax.tree.leaves(prog.abstract_state):
    nbytes = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for device in x.sharding.device_set:
      per_device[device] = per_device.get(device, 0) + nbytes
  return max(per_device.values(), default=0)


def check_state_fits(prog: program.Program, capacity: int | None) -> int:
  """MemoryError, before any compile, when the state alone exceeds a chip's HBM."""
  need = state_bytes_per_chip(prog)
  if capacity is not None and need > capacity:
    device = prog.mesh.devices.flat[0]
    raise MemoryError(
        f"the train state alone needs {need / GIB:,.1f} GiB per chip (parameters and "
        f"optimizer state of {prog.num_params:,} parameters over mesh {dict(prog.mesh.shape)}),"
        f" but a {device.device_kind} has {capacity / GIB:.0f} GiB: use more chips or shard "
        "the parameters further (config.mesh.fsdp, config.mesh.expert)")
  return need


def compile_report(prog: program.Program, *, executable_dir: str | None = None,
                   log=print) -> tuple[Report, jax.stages.Compiled]:
  """(memory and FLOPs report, executable) of `prog`'s train step compiled on abstract arrays;
  executable_dir: where `executables` keeps compiled steps (None: compile, keep nothing)."""
  device = prog.mesh.devices.flat[0]
  t0 = time.time()
  try:
    compiled, loaded = executables.load_or_compile(
        "train_step", prog.lower_train_step, fields=program.program_key(prog.cfg),
        mesh=prog.mesh, directory=executable_dir, log=log)
  except Exception as e:  # noqa: BLE001  (XLA raises its runtime error type)
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # XLA:TPU refuses a program larger than HBM; its first line names the need and the room.
    xla = next((line.strip() for line in str(e).splitlines() if "memory" in line.lower()),
               str(e).splitlines()[0])
    capacity = hbm_bytes(device)
    cap = f" of {capacity / GIB:.0f} GiB" if capacity else ""
    raise MemoryError(
        f"the train step does not fit a {device.device_kind}'s HBM{cap} per chip on mesh "
        f"{dict(prog.mesh.shape)} (XLA, after {time.time() - t0:.0f} s: {xla}): use more "
        "chips, more fsdp/expert sharding, a smaller batch per chip (config.train.microbatches)"
        " or more rematerialization (config.model.remat)") from None
  seconds = time.time() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  t = prog.cfg.train
  capacity, limit = hbm_bytes(device), allocator_bytes(device)
  report = Report(
      device_kind=device.device_kind, chips=prog.mesh.devices.size, mesh=dict(prog.mesh.shape),
      argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
      alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
      code_bytes=mem.generated_code_size_in_bytes, capacity_bytes=capacity,
      allocator_bytes=limit if limit and capacity and limit < capacity else None,
      flops_per_chip=(cost or {}).get("flops"), tokens_per_step=t.global_batch * t.seq_len,
      compile_seconds=seconds, loaded=loaded,
      slices={a: n for a, n in parallel.slices_along(prog.mesh).items() if n > 1})
  return report, compiled


def check_fits(report: Report) -> None:
  """MemoryError naming the need and the capacity per chip (or the allocator's smaller
  share of it, and how to raise that) when the step does not fit."""
  if report.fits is False and report.total_bytes <= report.capacity_bytes:
    raise MemoryError(
        f"the train step needs {report.total_bytes / GIB:.2f} GiB of HBM per chip, within a "
        f"{report.device_kind}'s {report.capacity_bytes / GIB:.0f} GiB but over the "
        f"{report.allocator_bytes / GIB:.2f} GiB this process's allocator may use: on GPUs "
        f"raise config.train.gpu_memory_fraction (or {SHARE_VARIABLE}; JAX's default 0.75; "
        "e.g. 0.95), or use more chips, a smaller batch per chip (config.train.microbatches) "
        "or more rematerialization (config.model.remat)")
  if report.fits is False:
    raise MemoryError(
        f"the train step needs {report.total_bytes / GIB:.2f} GiB of HBM per chip "
        f"(arguments {report.argument_bytes / GIB:.2f}, temporaries "
        f"{report.temp_bytes / GIB:.2f}), but a {report.device_kind} has "
        f"{report.capacity_bytes / GIB:.0f} GiB: use more chips, more fsdp/expert sharding, "
        "a smaller batch per chip or more rematerialization (config.model.remat)")


def preflight(prog: program.Program, *, log=print, step_time: float | None = None,
              executable_dir: str | None = None) -> tuple[Report | None, Any]:
  """Both fit checks: (report, compiled step), or (None, jitted step) on CPU;
  executable_dir: `compile_report`'s."""
  capacity = hbm_bytes(prog.mesh.devices.flat[0])
  need = check_state_fits(prog, capacity)
  if capacity is None:
    return None, prog.train_step
  log(f"train state: {need / GIB:.1f} GiB per chip of {capacity / GIB:.0f} GiB; train step: "
      "compiling to check its memory ...")
  report, compiled = compile_report(prog, executable_dir=executable_dir, log=log)
  log("\n".join(report.lines(step_time)))
  check_fits(report)
  return report, compiled

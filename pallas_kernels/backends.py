"""The backend names the ops' dispatchers share, and their check of a name.

"reference": the op's plain-JAX form (`reference.py`); "kernel": the lowering platform's
kernels; "interpret": the kernels in Pallas interpret mode, on any platform; "auto": chosen
per platform (and shape) at lowering. An op adds a name of its own only where these would
mislead (grouped_matmul's "kernel_ws", newton_schulz's "gram_reference").

`deterministic()`: while it is on, dispatchers trace only kernels whose results repeat bit
for bit under XLA's deterministic mode (`train.deterministic`)."""

import contextlib
import contextvars

_DETERMINISTIC = contextvars.ContextVar("deterministic_kernels", default=False)


@contextlib.contextmanager
def deterministic(on: bool = True):
  """Traces inside it pick kernels that repeat bit for bit: on GPUs, attention takes the
  Triton kernel, not cuDNN's (whose deterministic backward fails to run in XLA:
  benchmarks/results/train_step.md). A jitted function keeps the kernels of its first
  trace, so build one per setting (as `k3jax.program.build` does)."""
  token = _DETERMINISTIC.set(on)
  try:
    yield
  finally:
    _DETERMINISTIC.reset(token)


def deterministic_only() -> bool:
  """Whether the current trace is inside `deterministic()`."""
  return _DETERMINISTIC.get()


def check_backend(op: str, backend: str, backends, renamed=None) -> None:
  """ValueError unless backend is one of backends; an old name, a key of renamed
  {old: new}, is told its new one."""
  if backend in backends:
    return
  renamed = renamed or {}
  hint = f" ({backend!r} was renamed {renamed[backend]!r})" if backend in renamed else ""
  raise ValueError(f"unknown {op} backend {backend!r}{hint}; choose one of {backends}")

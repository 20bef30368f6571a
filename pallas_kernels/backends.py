"""The backend names the ops' dispatchers share, and their check of a name.

"reference": the op's plain-JAX form (`reference.py`); "kernel": the lowering platform's
kernels; "interpret": the kernels in Pallas interpret mode, on any platform; "auto": chosen
per platform (and shape) at lowering. An op adds a name of its own only where these would
mislead (grouped_matmul's "kernel_ws", newton_schulz's "gram_reference")."""


def check_backend(op: str, backend: str, backends, renamed=None) -> None:
  """ValueError unless backend is one of backends; an old name, a key of renamed
  {old: new}, is told its new one."""
  if backend in backends:
    return
  renamed = renamed or {}
  hint = f" ({backend!r} was renamed {renamed[backend]!r})" if backend in renamed else ""
  raise ValueError(f"unknown {op} backend {backend!r}{hint}; choose one of {backends}")

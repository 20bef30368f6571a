"""Imports flow one way: entry points use the model, optimizer, data, checkpoint and parallel
packages; the model and the optimizer use pallas_kernels; pallas_kernels imports nothing
from k3jax; the model imports no data, optimizer or checkpoint code, and the data no model
code. The logical axes (`k3jax.axes`) and `k3jax.config_error` are leaves that import
nothing from k3jax; the optimizer and the parallel package share the axes with the model
without importing it; no package imports `k3jax.config`, which assembles their sections.
Read from the sources (every import statement, lazy ones inside functions too)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_modules(path: pathlib.Path) -> set[str]:
  """The absolute module names `path` imports (`from k3jax import x` counts as k3jax.x)."""
  package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: from the file's package, `level - 1` packages up
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
  return names


ENTRY = ("k3jax.config", "k3jax.checkpoint", "k3jax.train", "k3jax.steps", "k3jax.program")

# (the files: a folder or one module, the module prefixes they must not import)
RULES = {
    "pallas_kernels": ("pallas_kernels", ("k3jax",)),
    "axes": ("k3jax/axes.py", ("k3jax",)),
    "config_error": ("k3jax/config_error.py", ("k3jax",)),
    "model": ("k3jax/model", ("k3jax.data", "k3jax.optim", "k3jax.parallel", *ENTRY)),
    "data": ("k3jax/data", ("k3jax.model", "k3jax.optim", "k3jax.parallel", *ENTRY)),
    "optim": ("k3jax/optim", ("k3jax.model", "k3jax.data", "k3jax.parallel", *ENTRY)),
    "parallel": ("k3jax/parallel", ("k3jax.model", "k3jax.data", "k3jax.optim", *ENTRY)),
}
# Imports a rule refuses that are still there, each until its file is changed.
PENDING: set[tuple[str, str]] = set()


def within(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("rule", sorted(RULES))
def test_imports_flow_one_way(rule):
  where, banned = RULES[rule]
  path = ROOT / where
  files = [path] if path.is_file() else sorted(path.rglob("*.py"))
  assert files, where
  broken = sorted(f"{f.relative_to(ROOT)} imports {name}" for f in files
                  for name in imported_modules(f)
                  if any(within(name, b) for b in banned)
                  and not any(str(f.relative_to(ROOT)) == file and within(name, module)
                              for file, module in PENDING))
  assert not broken, "\n".join(broken)

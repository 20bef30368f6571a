"""Imports flow one way: entry points use the model, optimizer, data, checkpoint and parallel
packages; the model and the optimizer use pallas_kernels; pallas_kernels imports nothing
from k3jax; the model imports no data, optimizer or checkpoint code, and the data no model
code. Read from the sources (every import statement, lazy ones inside functions too)."""

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


# (the files, the module prefixes they must not import)
RULES = {
    "pallas_kernels": ("pallas_kernels", ("k3jax",)),
    "model": ("k3jax/model", ("k3jax.data", "k3jax.optim", "k3jax.checkpoint", "k3jax.train",
                              "k3jax.steps", "k3jax.program")),
    "data": ("k3jax/data", ("k3jax.model", "k3jax.optim", "k3jax.checkpoint", "k3jax.train")),
    "optim": ("k3jax/optim", ("k3jax.data", "k3jax.checkpoint", "k3jax.train")),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_imports_flow_one_way(rule):
  directory, banned = RULES[rule]
  files = sorted((ROOT / directory).rglob("*.py"))
  assert files, directory
  broken = sorted(f"{f.relative_to(ROOT)} imports {name}" for f in files
                  for name in imported_modules(f)
                  if any(name == b or name.startswith(b + ".") for b in banned))
  assert not broken, "\n".join(broken)

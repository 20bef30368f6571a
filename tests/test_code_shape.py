"""Code a reader takes in at once: no function or method outside tests/ longer than 80 lines
(from its `def` to the end of its body), and no measurement in a comment or docstring of
the framework or its kernels (figures live in benchmarks/results/, dated). Read from the
sources."""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 80
# a number with a unit of time, memory or speed, or a session number
MEASUREMENT = re.compile(r"\b\d[\d,.]*\s?(ms|GiB|MiB|GB/s|TFLOP/s|tok/s)\b|\bsession \d")


def sources(*folders):
  return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_no_function_is_longer_than_80_lines():
  long = []
  for path in sources("k3jax", "pallas_kernels", "benchmarks", "launch", "experiments"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_LINES:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, long


def prose(path: pathlib.Path):
  """(line, text) of every comment and docstring in `path`."""
  text = path.read_text()
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      yield tok.start[0], tok.string
  for node in ast.walk(ast.parse(text, str(path))):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        yield node.body[0].lineno, doc


def test_no_measurement_in_comments():
  found = [f"{path.relative_to(ROOT)}:{line} {MEASUREMENT.search(text).group(0)!r}"
           for path in sources("k3jax", "pallas_kernels", "experiments")
           for line, text in prose(path) if MEASUREMENT.search(text)]
  assert not found, found


def test_the_measurement_pattern_finds_what_it_is_for():
  for text in ("took 12.5 ms", "0.43 GiB a layer", "341 TFLOP/s", "as in session 9",
               "1,803.3 ms"):
    assert MEASUREMENT.search(text), text
  for text in ("16 x 4096 tokens", "bf16 operands", "the 2 cores", "msg"):
    assert not MEASUREMENT.search(text), text

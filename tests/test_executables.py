"""`k3jax.executables`: a compiled train step stored on disk and loaded by a rerun without
tracing or lowering; its key follows everything that decides the program and nothing that
does not; an unreadable stored executable is moved aside and the step compiled again."""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import micro_config
from k3jax import executables, memory, parallel, program


@contextlib.contextmanager
def jax_cache_in(directory, *, keep: bool):
  """JAX's persistent cache in `directory` (empty: a compile is XLA's, not an answer of the
  suite's cache), keeping every program or none."""
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415
  flags = {"jax_compilation_cache_dir": str(directory),
           "jax_persistent_cache_min_compile_time_secs": 0 if keep else 1e9,
           "jax_persistent_cache_min_entry_size_bytes": 0}
  saved = {flag: getattr(jax.config, flag) for flag in flags}
  for flag, value in flags.items():
    jax.config.update(flag, value)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    for flag, value in saved.items():
      jax.config.update(flag, value)
    compilation_cache.reset_cache()


@pytest.fixture
def no_jax_cache(tmp_path):
  with jax_cache_in(tmp_path / "jax_cache", keep=False):
    yield


@pytest.fixture
def jax_cache_keeping_all(tmp_path):
  with jax_cache_in(tmp_path / "jax_cache", keep=True):
    yield


def small_program():
  cfg = micro_config()
  cfg.model.num_layers, cfg.model.mla_every, cfg.model.dense_layers = 2, 2, 0
  return program.build(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:1]))


def batch_of(prog):
  """One document a row of random tokens."""
  shapes = prog.abstract_batch()
  rows, length = shapes["inputs"].shape
  tokens = np.random.default_rng(0).integers(1, 60, (rows, length + 1))
  values = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                segment_ids=np.ones_like(tokens[:, 1:]),
                positions=np.broadcast_to(np.arange(length), (rows, length)),
                weights=np.ones((rows, length)))
  return {name: jax.device_put(values[name].astype(s.dtype), s.sharding)
          for name, s in shapes.items()}


def test_a_rerun_loads_the_stored_train_step_without_tracing_it(tmp_path, monkeypatch,
                                                                no_jax_cache):
  """The first compile stores the step; a rerun loads it with lowering forbidden, reports
  the same memory and FLOPs, and one step of each gives the same state and loss bit for
  bit."""
  prog = small_program()
  first, compiled = memory.compile_report(prog, executable_dir=tmp_path)
  assert not first.loaded and "compiled in" in "\n".join(first.lines())
  assert [p.name.split("-")[0] for p in (tmp_path / "executables").iterdir()] == ["train_step"]

  logged = []

  def no_tracing(self):
    raise AssertionError("a stored step was traced again")

  monkeypatch.setattr(program.Program, "lower_train_step", no_tracing)
  again, loaded = memory.compile_report(prog, executable_dir=tmp_path, log=logged.append)
  assert again.loaded and "loaded in" in "\n".join(again.lines())
  assert "train_step loaded from" in logged[0]
  for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                "flops_per_chip"):
    assert getattr(again, field) == getattr(first, field), field

  with prog.rules():
    outs = [step(*prog.init(), batch_of(prog)) for step in (compiled, loaded)]
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_key_follows_what_decides_the_program(monkeypatch):
  """Another config field, another device, a jax flag, XLA_FLAGS or the source give
  another key; where caches and logs go does not."""
  devices = jax.devices()
  mesh = Mesh(np.asarray(devices[:1]), ("data",))
  base = executables.key("{}", mesh)
  assert executables.key("{}", mesh) == base
  assert executables.key('{"seq_len": 64}', mesh) != base
  assert executables.key("{}", Mesh(np.asarray(devices[1:2]), ("data",))) != base
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/x")
  assert executables.key("{}", mesh) != base
  monkeypatch.undo()
  monkeypatch.setattr(executables, "source_digest", lambda: "0" * 64)
  assert executables.key("{}", mesh) != base
  monkeypatch.undo()
  for flag, value in (("jax_default_matmul_precision", "highest"), ("jax_enable_x64", True)):
    before = getattr(jax.config, flag)
    jax.config.update(flag, value)
    try:
      assert executables.key("{}", mesh) != base, flag
    finally:
      jax.config.update(flag, before)
  for flag, value in (("jax_compilation_cache_dir", "/elsewhere"), ("jax_log_compiles", True)):
    before = getattr(jax.config, flag)
    jax.config.update(flag, value)
    try:
      assert executables.key("{}", mesh) == base, flag
    finally:
      jax.config.update(flag, before)


def cumsum_program(directory):
  """(x, store): store(log) is `load_or_compile` of a small sharded program on 2 devices."""
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  fn = jax.jit(lambda x: {"y": jnp.cumsum(x) * 2})
  return x, fn, lambda log=print: executables.load_or_compile(
      "cumsum", lambda: fn.lower(x), fields='{"test": "cumsum"}', mesh=mesh,
      directory=directory, log=log)


def test_a_program_jaxs_cache_answered_is_not_stored(tmp_path, jax_cache_keeping_all):
  """Re-serialized, such an executable fails at run time on CPU ("Function ... not found"):
  the store keeps only what XLA compiled in this process."""
  x, fn, store = cumsum_program(tmp_path)
  fn.lower(x).compile()    # into JAX's cache
  jax.clear_caches()       # as a new process: only the persistent cache has it
  logged = []
  compiled, loaded = store(logged.append)
  assert not loaded and "came from JAX's compilation cache; not stored" in logged[0]
  assert not (tmp_path / "executables").exists()
  np.testing.assert_array_equal(np.asarray(compiled(x)["y"]), 2 * np.cumsum(np.arange(8.0)))


@pytest.mark.parametrize("damage", ["truncated", "another format", "another program"])
def test_an_unreadable_executable_is_moved_aside_and_compiled_again(tmp_path, damage,
                                                                   no_jax_cache):
  """A damaged, foreign or misnamed stored file: a line naming it, the file kept as
  <name>.unreadable, the program compiled and stored afresh, and its result right."""
  x, _, store = cumsum_program(tmp_path)
  _, loaded = store()
  assert not loaded
  (path,) = (tmp_path / "executables").iterdir()
  import pickle  # noqa: PLC0415
  if damage == "truncated":
    path.write_bytes(path.read_bytes()[:1000])
  elif damage == "another format":
    path.write_bytes(pickle.dumps({"format": 0}))
  else:   # a whole file under this name, stored for some other key
    stored = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps({**stored, "key": "0" * 64}))
  logged = []
  compiled, loaded = store(logged.append)
  assert not loaded
  assert str(path) in logged[0] and "could not be loaded" in logged[0]
  assert (path.parent / (path.name + ".unreadable")).exists() and path.exists()
  np.testing.assert_array_equal(np.asarray(compiled(x)["y"]), 2 * np.cumsum(np.arange(8.0)))
  again, loaded = store()
  assert loaded
  np.testing.assert_array_equal(np.asarray(again(x)["y"]), 2 * np.cumsum(np.arange(8.0)))

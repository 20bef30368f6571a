"""`k3jax.executables`: a compiled train step stored on disk and loaded by a rerun without
tracing or lowering; its key follows everything that decides the program and nothing that
does not; an unreadable stored executable is moved aside and the step compiled again."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import micro_config
from k3jax import executables, memory, parallel, program


@pytest.fixture(autouse=True)
def _fresh_process_memory():
  """Each test starts as a new process would: nothing loaded yet."""
  executables._LOADED.clear()
  yield
  executables._LOADED.clear()


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


def test_a_rerun_loads_the_stored_train_step_without_tracing_it(tmp_path, monkeypatch):
  """The first compile stores the step; a rerun (nothing in this process' memory) loads it
  with lowering forbidden, reports the same memory and FLOPs, and one step of each gives
  the same state and loss bit for bit."""
  prog = small_program()
  first, compiled = memory.compile_report(prog, executable_dir=tmp_path)
  assert not first.loaded and "compiled in" in "\n".join(first.lines())
  assert [p.name.split("-")[0] for p in (tmp_path / "executables").iterdir()] == ["train_step"]

  executables._LOADED.clear()
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


@pytest.mark.parametrize("damage", ["truncated", "another format"])
def test_an_unreadable_executable_is_moved_aside_and_compiled_again(tmp_path, damage):
  """A damaged or foreign stored file: a line naming it, the file kept as <name>.unreadable,
  the program compiled and stored afresh, and its result right."""
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  fn = jax.jit(lambda x: {"y": jnp.cumsum(x) * 2})
  fields = '{"test": "cumsum"}'
  store = lambda log=print: executables.load_or_compile(  # noqa: E731
      "cumsum", lambda: fn.lower(x), fields=fields, mesh=mesh, directory=tmp_path, log=log)
  _, loaded = store()
  assert not loaded
  (path,) = (tmp_path / "executables").iterdir()
  if damage == "truncated":
    path.write_bytes(path.read_bytes()[:1000])
  else:
    import pickle  # noqa: PLC0415
    path.write_bytes(pickle.dumps({"format": 0}))
  executables._LOADED.clear()
  logged = []
  compiled, loaded = store(logged.append)
  assert not loaded
  assert str(path) in logged[0] and "could not be loaded" in logged[0]
  assert (path.parent / (path.name + ".unreadable")).exists() and path.exists()
  np.testing.assert_array_equal(np.asarray(compiled(x)["y"]), 2 * np.cumsum(np.arange(8.0)))
  executables._LOADED.clear()
  again, loaded = store()
  assert loaded
  np.testing.assert_array_equal(np.asarray(again(x)["y"]), 2 * np.cumsum(np.arange(8.0)))

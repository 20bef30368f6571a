"""Object-store workdirs and data (`gs://`) through one path layer (k3jax.paths, etils.epath).

No network: `gs://` is served by a fake object store, a local folder behind epath's own
fsspec backend (the one epath uses for gs:// without TensorFlow; gcsfs would be the real
filesystem). Like GCS it refuses append mode, so the writers must work without it.
"""

import gzip
import json
import os

import jax
import numpy as np
import pytest
from etils.epath import backend, gpath
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from k3jax import checkpoint, data, metrics, paths, profile
from k3jax.data import images, sources


class FakeObjectStore(DirFileSystem):
  """`gs://bucket/key` -> `<root>/bucket/key`; no append, as on GCS."""
  protocol = ("gs", "gcs")

  def open(self, path, mode="rb", *args, **kwargs):
    if "a" in mode:
      raise NotImplementedError(f"object store: no append mode ({path})")
    return super().open(path, mode, *args, **kwargs)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """The local folder that backs `gs://bucket`."""
  fs = FakeObjectStore(path=str(tmp_path / "store"), fs=LocalFileSystem())
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)   # epath's fsspec backend
  monkeypatch.setattr(backend.fsspec_backend, "fs", lambda path: fs)
  root = tmp_path / "store" / "bucket"
  root.mkdir(parents=True)
  return root


def test_urls_stay_urls_local_paths_expand(monkeypatch, tmp_path):
  assert str(paths.path("gs://bucket/run", absolute=True)) == "gs://bucket/run"
  assert str(paths.path("gs://bucket/run") / "metrics.jsonl") == "gs://bucket/run/metrics.jsonl"
  monkeypatch.chdir(tmp_path)
  assert str(paths.path("runs/x", absolute=True)) == str(tmp_path / "runs" / "x")
  monkeypatch.setenv("HOME", str(tmp_path))
  assert str(paths.path("~/x")) == str(tmp_path / "x")


def test_glob_on_the_object_store(bucket):
  (bucket / "data" / "sub").mkdir(parents=True)
  for name in ("b.txt", "a.txt", "c.json", "sub/d.txt"):
    (bucket / "data" / name).write_text(name)
  assert paths.glob("gs://bucket/data/*.txt") == ["gs://bucket/data/a.txt",
                                                 "gs://bucket/data/b.txt"]
  assert paths.glob("gs://bucket/data/*/*.txt") == ["gs://bucket/data/sub/d.txt"]
  assert paths.glob("gs://bucket/data/c.json") == ["gs://bucket/data/c.json"]
  assert paths.glob("gs://bucket/data/none.json") == []
  assert paths.is_file("gs://bucket/data/a.txt") and not paths.is_file("gs://bucket/data/sub")
  assert paths.mtime("gs://bucket/data/a.txt") > 0
  with pytest.raises(ValueError, match=r"'\*\*' is not supported"):
    paths.glob("gs://bucket/data/**/*.txt")


def test_metric_writer_on_the_object_store(bucket):
  w = metrics.MetricWriter("gs://bucket/run")
  w.write_scalars(1, {"loss": 3.0})
  w.write_scalars(2, {"loss": 2.0})
  w.flush()   # the whole file uploaded
  assert [r["step"] for r in metrics.read_jsonl("gs://bucket/run/metrics.jsonl")] == [1, 2]
  w.write_scalars(3, {"loss": 1.0})
  w.close()
  assert not (bucket / "run" / "tensorboard").exists()   # TensorBoard: local workdirs only
  # A killed run's partial last line and steps past the checkpoint are dropped on resume.
  with open(bucket / "run" / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "lo')
  w = metrics.MetricWriter("gs://bucket/run", resume_step=2)
  w.write_scalars(3, {"loss": 0.5})
  w.close()
  recs = metrics.read_jsonl(bucket / "run" / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in recs] == [(1, 3.0), (2, 2.0), (3, 0.5)]


def test_text_sources_on_the_object_store(bucket):
  (bucket / "corpus").mkdir()
  (bucket / "corpus" / "a.txt").write_text("first|second")
  with gzip.open(bucket / "corpus" / "b.jsonl.gz", "wt") as f:
    f.write(json.dumps({"text": "third"}) + "\n")
  cfg = data.data_config()
  cfg.source = "files"
  cfg.heldout_every = 0   # every document trains
  cfg.sources = [dict(paths="gs://bucket/corpus/*.txt", format="text", separator="|"),
                 dict(paths="gs://bucket/corpus/*.jsonl.gz", format="jsonl")]
  got = data.source_pieces(cfg, data.ByteTokenizer(), seq_len=64, split="train")
  texts = [data.ByteTokenizer().decode(p[i]["inputs"][1:]) for p, _ in got
           for i in range(len(p))]
  assert texts == ["first", "second", "third"]


def test_image_manifest_on_the_object_store(bucket):
  (bucket / "img").mkdir()
  pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
  np.save(bucket / "img" / "a.npy", pixels)
  (bucket / "img" / "m.jsonl").write_text(json.dumps({"image": "a.npy", "text": "t"}) + "\n")
  [entry] = images.read_manifests("gs://bucket/img/*.jsonl", "train", 0)
  assert entry["path"] == "gs://bucket/img/a.npy"   # relative to the manifest, still a URL
  np.testing.assert_array_equal(images.load_pixels(entry["path"]), pixels)


def test_checkpointer_keeps_a_url_workdir(bucket, monkeypatch):
  from orbax.checkpoint._src.path import gcs_utils
  # Orbax asks the bucket's layout through google-cloud-storage: a flat fake bucket here.
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  ckpt = checkpoint.Checkpointer("gs://bucket/run", keep=1, async_save=False)
  try:
    assert str(ckpt.directory) == "gs://bucket/run/checkpoints"
    assert (bucket / "run" / "checkpoints").is_dir()   # created, probed, through epath
    assert ckpt.latest_step() is None
  finally:
    ckpt.close()
  checkpoint.check_free_space(ckpt.directory, 2**62)   # unknown on an object store: no error


def test_profile_hlo_on_the_object_store(bucket, monkeypatch):
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
  trace = profile.StepTrace((1, 1), "gs://bucket/run/profile", lambda: "HloModule m")
  trace.active = True   # as after `before(1)`, without starting the profiler
  trace.close()
  assert (bucket / "run" / "profile" / "train_step.hlo.txt").read_text() == "HloModule m"


def test_local_sources_keep_recursive_globs_and_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  (tmp_path / "d" / "e").mkdir(parents=True)
  (tmp_path / "d" / "e" / "x.txt").write_text("x")
  assert sources.expand_paths(["~/d/**/*.txt"], "f") == [os.path.join(tmp_path, "d/e/x.txt")]

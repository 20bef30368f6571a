"""k3jax.convert.safetensors: files in the format's own layout read back exactly, rows
read by their bytes alone, streaming writes that leave nothing half-written, and a clear
error, naming file and tensor, for each way a file or index can be broken."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from k3jax.convert import safetensors as st


def tensors():
  rng = np.random.default_rng(0)
  return {"a.weight": rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16),
          "b.weight_packed": rng.integers(0, 256, (4, 16), dtype=np.uint8),
          "c.scale": np.float32(3.5).reshape(()),
          "d.bias": rng.standard_normal(7).astype(np.float32)}


def test_a_file_built_by_hand_from_the_format_reads_back():
  """Header length, JSON with __metadata__ and space padding, offsets relative to the data:
  built byte by byte here, not by our writer."""
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.asarray([1, 2, 3], np.uint8)
  header = {"__metadata__": {"format": "pt"},
            "b": {"dtype": "U8", "shape": [3], "data_offsets": [24, 27]},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
  text = json.dumps(header).encode() + b"    "
  path = "/tmp/k3jax-st-hand.safetensors"
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text + a.tobytes() + b.tobytes())
  infos, metadata = st.read_header(path)
  assert metadata == {"format": "pt"} and set(infos) == {"a", "b"}
  np.testing.assert_array_equal(st.read(infos["a"]), a)
  np.testing.assert_array_equal(st.read(infos["b"]), b)


def test_write_then_read_every_dtype_and_rows(tmp_path, monkeypatch):
  """Round trip of bf16, uint8, a scalar and fp32; a slice of rows reads exactly its
  rows' bytes (one pread of 2 rows x 5 x 2 bytes at the right offset)."""
  path = str(tmp_path / "m.safetensors")
  want = tensors()
  assert st.write(path, want, metadata={"format": "pt"}) == sum(v.nbytes for v in want.values())
  infos, _ = st.read_header(path)
  for name, value in want.items():
    got = st.read(infos[name])
    assert got.dtype == value.dtype and got.shape == value.shape
    np.testing.assert_array_equal(got, value)
  calls = []
  real = os.pread
  monkeypatch.setattr(os, "pread", lambda fd, n, at: calls.append((n, at)) or real(fd, n, at))
  np.testing.assert_array_equal(st.read(infos["a.weight"], slice(3, 5)), want["a.weight"][3:5])
  assert calls == [(2 * 5 * 2, infos["a.weight"].begin + 3 * 5 * 2)]


def test_streaming_write_checks_each_tensor_and_leaves_nothing_on_failure(tmp_path):
  path = str(tmp_path / "m.safetensors")
  entries = [("x", np.dtype(np.float32), (2,)), ("y", np.dtype(np.uint8), (3,))]
  arrays = iter([("x", np.ones(2, np.float32)), ("y", np.ones(4, np.uint8))])
  with pytest.raises(ValueError, match=r"expected y uint8 \[3\], got y uint8 \[4\]"):
    st.write(path, arrays, entries)
  assert os.listdir(tmp_path) == []


def broken(tmp_path, edit):
  path = str(tmp_path / "m.safetensors")
  st.write(path, tensors())
  raw = bytearray(open(path, "rb").read())
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  raw = edit(raw, header, n)
  with open(path, "wb") as f:
    f.write(raw)
  return path


def rewrite(header, n, data):
  text = json.dumps(header).encode()
  text += b" " * (n - len(text)) if len(text) <= n else b""
  return bytearray(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("edit, match", [
    (lambda raw, h, n: raw[:-3], r"'d.bias' ends at byte \d+ of a \d+-byte file \(truncated\)"),
    (lambda raw, h, n: raw[:5], "too short for a safetensors header"),
    (lambda raw, h, n: raw[:8] + b"{not json" + raw[17:], "the header is not JSON"),
    (lambda raw, h, n: rewrite({**h, "a.weight": {**h["a.weight"], "dtype": "F4"}}, n,
                               raw[8 + n:]), "'a.weight' has dtype 'F4'"),
    (lambda raw, h, n: rewrite({**h, "a.weight": {**h["a.weight"], "shape": [6, 6]}}, n,
                               raw[8 + n:]), r"'a.weight' of BF16 \[6, 6\] holds 60 bytes"),
    (lambda raw, h, n: rewrite({**h, "d.bias": {**h["d.bias"], "data_offsets": [
        h["a.weight"]["data_offsets"][0], h["a.weight"]["data_offsets"][0] + 28]}}, n,
        raw[8 + n:]), "overlap"),
])
def test_broken_files_name_file_and_tensor(tmp_path, edit, match):
  path = broken(tmp_path, edit)
  with pytest.raises(st.FormatError, match=match) as e:
    st.read_header(path)
  assert path in str(e.value)


def test_index_maps_names_to_files_and_names_a_missing_shard(tmp_path):
  d = str(tmp_path)
  st.write(os.path.join(d, "model-00001-of-00002.safetensors"), {"x": np.ones(2, np.float32)})
  st.write_index(d, {"x": "model-00001-of-00002.safetensors",
                     "y": "model-00002-of-00002.safetensors"}, 16)
  with pytest.raises(st.FormatError, match="names model-00002-of-00002.safetensors, which is "
                                           "missing"):
    st.read_index(d)
  st.write(os.path.join(d, "model-00002-of-00002.safetensors"), {"y": np.ones(2, np.float32)})
  files = st.read_index(d)
  assert files["y"].endswith("model-00002-of-00002.safetensors")
  os.remove(os.path.join(d, st.INDEX))
  with pytest.raises(st.FormatError, match="neither"):
    st.read_index(d)

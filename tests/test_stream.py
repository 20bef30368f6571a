"""k3jax.convert.stream: sharded arrays assembled from reads of their own boxes only (8
simulated devices), sources composed (layers stacked, torch weights transposed, MXFP4
dequantized on the device) equal to the whole tensor assembled in memory."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.convert import safetensors as st
from k3jax.convert import stream
from k3jax.model import mxfp4


def mesh():
  return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("a", "b"))


def recording(full):
  boxes = []

  def read(box):
    boxes.append(box)
    return full[tuple(slice(a, b) for a, b in box)]
  return read, boxes


def test_each_process_reads_each_distinct_box_once():
  """[8, 12, 6] split 2 ways on axis 0 and 4 ways on axis 1: 8 boxes, each read once; axis 1
  over "b" only ("a" replicated):
  4 distinct boxes for 8 devices, each read once; all replicated: one box. Progress
  counts the bytes read."""
  full = np.arange(8 * 12 * 6, dtype=np.float32).reshape(8, 12, 6)
  for spec, distinct in ((P("a", "b"), 8), (P(None, None, None), 1), (P(None, "b"), 4)):
    read, boxes = recording(full)
    progress = stream.Progress(full.nbytes, log=lambda msg: None)
    abstract = jax.ShapeDtypeStruct(full.shape, np.float32,
                                    sharding=NamedSharding(mesh(), spec))
    got = stream.assemble(abstract, read, progress)
    np.testing.assert_array_equal(np.asarray(got), full)
    assert len(boxes) == len(set(boxes)) == distinct
    assert progress.done == full.nbytes       # the distinct boxes tile the array once


def test_a_source_of_the_wrong_shape_is_named():
  abstract = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=NamedSharding(mesh(), P("a")))
  with pytest.raises(ValueError, match=r"returned \(3, 4\) for the box \(\(0, 2\), \(0, 4\)\)"):
    stream.assemble(abstract, lambda box: np.zeros((3, 4), np.float32))


def test_layers_of_torch_weights_in_files_stack_transposed(tmp_path):
  """Three layers' [out 8, in 6] bf16 weights in two files, assembled as k3jax's stacked
  [layers 3, in 6, out 8] with out split over 4 devices: the same as stacking and
  transposing in memory; each device's read touches only the rows (out) it holds."""
  rng = np.random.default_rng(0)
  ws = [rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16) for _ in range(3)]
  st.write(str(tmp_path / "x1.safetensors"), {"l0": ws[0], "l1": ws[1]})
  st.write(str(tmp_path / "x2.safetensors"), {"l2": ws[2]})
  infos = {**st.read_header(str(tmp_path / "x1.safetensors"))[0],
           **st.read_header(str(tmp_path / "x2.safetensors"))[0]}
  source = stream.stacked([stream.transposed(stream.from_file(infos[f"l{i}"]))
                           for i in range(3)])
  abstract = jax.ShapeDtypeStruct((3, 6, 8), np.float32,
                                  sharding=NamedSharding(mesh(), P(None, None, "b")))
  got = np.asarray(stream.assemble(abstract, source))
  np.testing.assert_array_equal(got, np.stack([w.T for w in ws]).astype(np.float32))
  np.testing.assert_array_equal(stream.materialize(source(((1, 2), (0, 6), (2, 4)))),
                                ws[1].T[None, :, 2:4])


def test_mxfp4_experts_dequantize_from_their_rows(tmp_path):
  """Two experts' MXFP4 [out 4, in 64] weights, as k3jax's [experts, in, out]: the
  dequantized values, per device box."""
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, (2, 4, 64), dtype=np.uint8)
  scales = rng.integers(120, 130, (2, 4, 2), dtype=np.uint8)
  tensors = {}
  for e in range(2):
    tensors[f"e{e}.weight_packed"] = mxfp4.pack_codes(codes[e])
    tensors[f"e{e}.weight_scale"] = scales[e]
  path = str(tmp_path / "m.safetensors")
  st.write(path, tensors)
  infos = st.read_header(path)[0]
  source = stream.stacked([stream.transposed(stream.from_mxfp4(
      infos[f"e{e}.weight_packed"], infos[f"e{e}.weight_scale"])) for e in range(2)])
  abstract = jax.ShapeDtypeStruct((2, 64, 4), np.float32,
                                  sharding=NamedSharding(mesh(), P("a", None, "b")))
  want = np.stack([mxfp4.dequantize(mxfp4.pack_codes(codes[e]), scales[e]).T
                   for e in range(2)])
  np.testing.assert_array_equal(np.asarray(stream.assemble(abstract, source)), want)
  # the host holds the stored bytes (both experts' codes and scales, stacked), not float32
  part = source(((0, 2), (0, 64), (0, 4)))
  assert [(x.dtype, x.shape) for x in part.leaves] == [(np.uint8, (2, 4, 32)),
                                                        (np.uint8, (2, 4, 2))]
  with pytest.raises(st.FormatError, match="not the codes and scales of one MXFP4 weight"):
    stream.from_mxfp4(infos["e0.weight_packed"], infos["e0.weight_packed"])

"""MetricWriter (JSONL + TensorBoard events), format_duration, StepTimer."""

import glob
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.metrics import MetricWriter, StepTimer, format_duration, read_jsonl


def _read_events(path):
  """Scalar (tag, step, value) triples of an event file, from the TFRecord framing:
  u64 length, u32 masked crc(length), payload (an Event proto), u32 masked crc(payload)."""
  from tensorboardX.proto import event_pb2

  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    payload = data[pos + 12:pos + 12 + length]
    pos += 12 + length + 4
    event = event_pb2.Event.FromString(payload)
    for v in event.summary.value:
      out.append((v.tag, event.step, v.simple_value))
  return out


def test_jsonl_and_tensorboard(tmp_path):
  w = MetricWriter(tmp_path)
  w.write_scalars(10, {"loss": jnp.float32(2.5), "lr": np.float64(1e-3), "tokens": 4096})
  w.write_scalars(20, {"loss": 2.25, "grad_norm": jnp.array([0.5])})
  w.close()
  recs = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [10, 20]
  assert recs[0]["loss"] == 2.5 and recs[0]["lr"] == 1e-3 and recs[0]["tokens"] == 4096
  assert recs[1] == {"step": 20, "wall_time": recs[1]["wall_time"], "loss": 2.25,
                     "grad_norm": 0.5}
  files = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert len(files) == 1
  scalars = _read_events(files[0])
  assert ("loss", 10, 2.5) in scalars and ("loss", 20, 2.25) in scalars
  assert ("grad_norm", 20, 0.5) in scalars
  assert any(t == "lr" and s == 10 and math.isclose(v, 1e-3, rel_tol=1e-6)
             for t, s, v in scalars)


def test_reopen_appends(tmp_path):
  with MetricWriter(tmp_path) as w:
    w.write_scalars(1, {"loss": 3.0})
  with MetricWriter(tmp_path) as w:
    w.write_scalars(2, {"loss": float("nan")})
    w.flush()
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2   # flush makes it visible
  recs = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2] and math.isnan(recs[1]["loss"])


def test_disabled_writes_nothing(tmp_path):
  w = MetricWriter(tmp_path / "run", enabled=False)
  w.write_scalars(1, {"loss": 1.0})
  w.flush()
  w.close()
  assert not os.path.exists(tmp_path / "run")


def test_rejects_non_scalars(tmp_path):
  with MetricWriter(tmp_path, tensorboard=False) as w:
    with pytest.raises(ValueError, match="scalar"):
      w.write_scalars(1, {"x": np.zeros(3)})
    with pytest.raises(ValueError, match="reserved"):
      w.write_scalars(1, {"step": 1})


def test_format_duration():
  assert format_duration(0) == "0s"
  assert format_duration(45.4) == "45s"
  assert format_duration(185) == "3m05s"
  assert format_duration(2 * 3600 + 7 * 60 + 59) == "2h07m"
  assert format_duration(3 * 86400 + 4 * 3600 + 5) == "3d04h"
  assert format_duration(float("inf")) == "?"
  assert format_duration(-61) == "-1m01s"


def test_step_timer():
  now = [100.0]
  t = StepTimer(tokens_per_step=1000, total_steps=110, start_step=0, clock=lambda: now[0])
  now[0] = 105.0
  r = t.update(10)
  assert r["steps_per_sec"] == 2.0 and r["tokens_per_sec"] == 2000.0
  assert r["step_time"] == 0.5 and r["eta_seconds"] == 50.0
  assert t.update(10) == {}

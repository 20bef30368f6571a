"""The benchmarks time what a train step runs: a part's fwd+bwd computes its forward too."""

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import moe as moe_benchmark  # noqa: E402  (benchmarks/ is not a package)


def test_moe_fwd_and_bwd_keeps_the_forward_products_the_backward_does_not_need():
  """Three matmuls, fwd+bwd: 3 forward products, 2 x 3 backward ones. A matmul's backward
  does not read its output, so unless the timed function returns it, XLA drops the forward
  and a linear part's "fwd+bwd" is its backward alone (seen on the H200: 108% of the
  einsum ceiling)."""
  f = moe_benchmark.three_matmuls(jnp.matmul)
  w = {"g": jnp.ones((8, 16)), "u": jnp.ones((8, 16)), "d": jnp.ones((16, 8))}
  xs = (jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((4, 16)))
  _, bwd, dy = moe_benchmark.fwd_and_bwd(f, w, xs)
  hlo = bwd.lower(w, xs, dy).compile().as_text()
  assert hlo.count(" dot(") == 9, hlo


def test_paired_times_difference_each_pair():
  """Two builds timed in alternation: each one's median, and the median, min and max of the
  pairs' differences, where a drift both saw cancels."""
  from harness import paired  # noqa: PLC0415
  a, b = [0.010, 0.020, 0.030], [0.011, 0.021, 0.032]
  assert paired(a, b) == pytest.approx((0.020, 0.021, 0.001, 0.001, 0.002))
  with pytest.raises(ValueError, match="equal, non-empty"):
    paired(a, b[:2])


@pytest.mark.parametrize("override,message", [
    ("train.microbatchez=2", "not a field; did you mean train.microbatches"),
    ("model.d_model=64", "changes the parameters or optimizer state")])
def test_train_step_ab_refuses_a_bad_build_before_compiling(override, message):
  """`train_step.py --ab`: a typo, or a build that could not take the config's state in
  turns, is a config error (exit 2) before the minutes of compile; `--config FILE` as two
  words is read too."""
  root = pathlib.Path(__file__).resolve().parents[1]
  run = subprocess.run(
      [sys.executable, "benchmarks/train_step.py", "--config", "experiments/k3_tiny.py",
       "--variants=", "--nons_blocks", f"--ab={override}"],
      cwd=root, capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 2 and "config error: --ab" in run.stderr, run.stderr[-2000:]
  assert message in run.stderr, run.stderr[-2000:]
  assert "compiled" not in run.stdout

"""The benchmarks time what a train step runs: a part's fwd+bwd computes its forward too."""

import pathlib
import sys

import jax.numpy as jnp

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

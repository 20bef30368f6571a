"""Grouped matmul (pallas_kernels/grouped_matmul): the reference is a matmul per group (empty
groups, rows past the groups); its custom VJP equals autodiff of `jax.lax.ragged_dot`; the
dispatcher's backends and the errors the kernel path names; the Mosaic GPU kernel's forward
equals a matmul per group in Mosaic GPU's interpreter, and it lowers for CUDA from this CPU,
forward and lhs gradient (the weight gradient's kernel traces on a GPU host only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (grouped_matmul, kernel, kernel_ws, reference,
                                           resolve_backend)

SIZES = [5, 0, 9, 4]  # an empty group; 2 of M = 20 rows past the groups


def operands(seed, M=20, K=8, N=6, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((M, K)).astype(np.float32)
  rhs = rng.standard_normal((len(SIZES), K, N)).astype(np.float32)
  return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(SIZES, jnp.int32)


def assert_bf16_rounding_of(out, exact):
  """out (bf16) differs from the float64 exact only by the output's rounding: half an ulp
  of each value (8 significant bits), 1e-3 near zero."""
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= 0.5 * ulp + 1e-3)


def per_group(lhs, rhs, sizes=SIZES):
  """numpy float64: every group's rows times its matrix, zero past the groups."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    out[start:start + size] = lhs[start:start + size] @ rhs[g]
    start += size
  return out


def test_reference_is_a_matmul_per_group():
  lhs, rhs, sizes = operands(0)
  np.testing.assert_allclose(reference.gmm(lhs, rhs, sizes), per_group(lhs, rhs), rtol=1e-5,
                             atol=1e-5)
  swapped = jnp.swapaxes(rhs, 1, 2)
  np.testing.assert_allclose(reference.gmm(lhs, swapped, sizes, transpose_rhs=True),
                             per_group(lhs, rhs), rtol=1e-5, atol=1e-5)
  dout = jnp.asarray(np.random.default_rng(1).standard_normal((20, 6)), jnp.float32)
  dw = reference.tgmm(lhs, dout, sizes)
  assert dw.shape == rhs.shape and not np.any(np.asarray(dw[1]))  # the empty group
  np.testing.assert_allclose(dw[2], np.asarray(lhs[5:14]).T @ np.asarray(dout[5:14]),
                             rtol=1e-5, atol=1e-5)


def test_vjp_is_autodiff_of_ragged_dot():
  """Gradients of both operands through the custom VJP (two more grouped products) equal
  JAX's autodiff of `ragged_dot`, fp32, with an empty group and rows past the groups; the
  output is lhs's dtype (bf16 in, bf16 out)."""
  lhs, rhs, sizes = operands(2)
  dout = jnp.asarray(np.random.default_rng(3).standard_normal((20, 6)), jnp.float32)
  ours = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, backend="reference")
                                       * dout), (0, 1))(lhs, rhs)
  ref = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes) * dout), (0, 1))(lhs, rhs)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  lhs16, rhs16, _ = operands(2, dtype=jnp.bfloat16)
  assert grouped_matmul(lhs16, rhs16, sizes, backend="reference").dtype == jnp.bfloat16


def test_backends_and_errors():
  assert resolve_backend("auto", "gpu") == "kernel_ws"
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  # "auto" on a GPU: the warp-specialized kernels where their tiles fit, else the per-tile
  # kernel where its do, else the reference
  assert resolve_backend("auto", "gpu", sd(256, 256), sd(4, 256, 256)) == "kernel_ws"
  assert resolve_backend("auto", "gpu", sd(24, 128), sd(4, 128, 128)) == "kernel"
  assert resolve_backend("auto", "gpu", sd(20, 128), sd(4, 128, 128)) == "reference"
  assert resolve_backend("auto", "tpu") == resolve_backend("auto", "cpu") == "reference"
  lhs, rhs, sizes = operands(4)
  with pytest.raises(ValueError, match="unknown grouped-matmul backend 'triton'"):
    grouped_matmul(lhs, rhs, sizes, backend="triton")
  with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
    grouped_matmul(lhs, rhs[:, :4], sizes)
  with pytest.raises(ValueError, match="group_sizes"):
    grouped_matmul(lhs, rhs, sizes[:3])
  with pytest.raises(ValueError, match="bf16 or fp16 operands of one dtype"):
    grouped_matmul(lhs, rhs, sizes, backend="kernel", platform="gpu")
  # "auto" on a GPU takes the reference where the kernel's tiles do not fit
  np.testing.assert_array_equal(grouped_matmul(lhs, rhs, sizes, platform="gpu"),
                                grouped_matmul(lhs, rhs, sizes, backend="reference"))
  with pytest.raises(ValueError, match="M=20 to be a multiple of 8 rows"):
    kernel.check(sd(20, 128), sd(4, 128, 128))
  with pytest.raises(ValueError, match="K=96 to be a multiple of block_k=64"):
    kernel.check(sd(24, 96), sd(4, 96, 128))
  with pytest.raises(ValueError, match="N=96 to be a multiple of the lhs gradient's block_k"):
    kernel.check(sd(24, 128), sd(4, 128, 96))
  with pytest.raises(ValueError, match="N=64 to be a multiple of the weight gradient's block_n"):
    kernel.check(sd(24, 128), sd(4, 128, 64))


@pytest.mark.parametrize("sizes", [[70, 0, 100, 50, 0], [64, 64, 0, 128], [0, 0, 5, 250]])
def test_tile_table_lists_each_block_once_per_group(sizes):
  """The forward kernel's work list: for every group, the row blocks it has rows in, in
  order, with the group's first row in the block and row count; no tile for an empty
  group; the rows past the groups as one more group (G, written zero); nothing else."""
  bm, rows = 64, 256
  table, count = kernel.tile_table(jnp.asarray(sizes, jnp.int32), rows, bm)
  expected, start = [], 0
  for g, size in enumerate(sizes + [rows - sum(sizes)]):
    for block in range(start // bm, -(-(start + size) // bm) if size else 0):
      lo, hi = max(start, block * bm), min(start + size, (block + 1) * bm)
      expected.append((g, block, lo - block * bm, hi - lo))
    start += size
  bound = rows // bm + len(sizes)
  assert table.shape == (4 * bound,) and int(count[0]) == len(expected) <= bound
  listed = np.asarray(table).reshape(4, bound).T[:len(expected)]
  assert [tuple(int(v) for v in t) for t in listed] == expected
  # no loop: on a GPU each iteration of a while loop waits on the host
  program = jax.jit(lambda s: kernel.tile_table(s, rows, bm)).lower(jnp.asarray(sizes))
  assert "while" not in program.as_text()


def test_kernel_matches_reference_in_interpreter():
  """The Mosaic GPU kernel's forward, run by Mosaic GPU's interpreter on this CPU, equals a
  matmul per group (bf16 in and out, fp32 accumulation): group boundaries inside a row
  block, an empty group, rows past the groups zeroed."""
  rng = np.random.default_rng(5)
  # 236 of M = 256 rows; M a multiple of the row block (past M, the interpreter refuses the
  # reads that TMA zero-fills on a GPU)
  sizes = [70, 0, 100, 50, 0]
  lhs = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((5, 128, 256)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  # 2 persistent CTAs: each walks several tiles; grid_block_n 2: the snake over columns
  out = kernel.gmm(lhs, rhs, gs, blocks=kernel.Blocks(64, 64, 64, 2, 2), interpret=True,
                   num_sms=2)
  exact = per_group(lhs, rhs, sizes)
  assert out.dtype == jnp.bfloat16
  assert_bf16_rounding_of(out, exact)
  assert not np.any(np.asarray(out[236:]))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_kernel_lowers_for_cuda(transpose_rhs):
  """The forward (and the lhs gradient's product, on rhs^T) through the Mosaic GPU kernel
  lowers for CUDA on this CPU-only host: one `mosaic_gpu` custom call."""
  sd = jax.ShapeDtypeStruct
  fn = lambda a, b, g: kernel.gmm(a, b, g, transpose_rhs=transpose_rhs)
  rhs = sd((4, 256, 512) if transpose_rhs else (4, 512, 256), jnp.bfloat16)
  text = jax.jit(fn).trace(sd((304, 512), jnp.bfloat16), rhs, sd((4,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_each_distinct_kernel_is_lowered_once():
  """Layers calling the kernel on the same shapes share one lowered function: three
  forward-and-backward calls lower to the three products' custom calls (gmm, gmm on rhs^T,
  tgmm), not nine."""
  sd = jax.ShapeDtypeStruct

  def layers(x, w, sizes):
    outs = [grouped_matmul(x, w, sizes, backend="kernel_ws") for _ in range(3)]
    return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
  args = sd((512, 1024), jnp.bfloat16), sd((4, 1024, 768), jnp.bfloat16), sd((4,), jnp.int32)
  text = jax.jit(jax.value_and_grad(layers, argnums=(0, 1))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("num_sms,chain", [(1, True), (3, True), (16, True), (3, False)])
def test_warp_specialized_kernel_matches_reference_in_interpreter(num_sms, chain):
  """`gmm_ws` in Mosaic GPU's interpreter equals a matmul per group: one CTA running all
  tiles as one chained pipeline (START, STEADY..., STOP), several CTAs, more CTAs than
  tiles (a lone tile starts and stops its pipeline), and a pipeline per tile."""
  rng = np.random.default_rng(6)
  sizes = [70, 0, 100, 50, 0]
  lhs = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((5, 256, 256)), jnp.bfloat16)
  out = kernel_ws.gmm_ws(lhs, rhs, jnp.asarray(sizes, jnp.int32),
                      blocks=kernel_ws.WSBlocks(64, 64, 64, 2, 2, 32, chain), interpret=True,
                      num_sms=num_sms)
  exact = per_group(lhs, rhs, sizes)
  assert_bf16_rounding_of(out, exact)
  assert not np.any(np.asarray(out[220:]))


@pytest.mark.parametrize("product", ["gmm_ws", "gmm_ws^T", "tgmm_ws"])
def test_warp_specialized_kernels_lower_for_cuda(product):
  """The warp-specialized products lower for CUDA at k3_small's expert shapes (shared memory
  within the H100 / H200's 227 KiB, checked in the lowering)."""
  sd = jax.ShapeDtypeStruct
  m, k, n, g = 65536, 1024, 768, 64
  fn, args = {
      "gmm_ws": (kernel_ws.gmm_ws, (sd((m, k), jnp.bfloat16), sd((g, k, n), jnp.bfloat16))),
      "gmm_ws^T": (lambda a, b, s: kernel_ws.gmm_ws(a, b, s, transpose_rhs=True),
                   (sd((m, n), jnp.bfloat16), sd((g, k, n), jnp.bfloat16))),
      "tgmm_ws": (kernel_ws.tgmm_ws, (sd((m, k), jnp.bfloat16), sd((m, n), jnp.bfloat16)))}[product]
  text = jax.jit(fn).trace(*args, sd((g,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_warp_specialized_backend_names_what_it_cannot_take():
  """backend="kernel_ws" checks its tiles up front: K and N by 2 block_n and by the chained
  pipeline's K steps, and the dtypes."""
  sd = jax.ShapeDtypeStruct
  ok = (sd((512, 1024), jnp.bfloat16), sd((4, 1024, 768), jnp.bfloat16))
  assert resolve_backend("kernel_ws", "gpu", *ok) == "kernel_ws"
  with pytest.raises(ValueError, match="N=640 to be a multiple of 2 block_n=256"):
    resolve_backend("kernel_ws", "gpu", sd((512, 1024), jnp.bfloat16),
                    sd((4, 1024, 640), jnp.bfloat16))
  with pytest.raises(ValueError, match="bf16 or fp16"):
    resolve_backend("kernel_ws", "gpu", sd((512, 1024), jnp.float32),
                    sd((4, 1024, 768), jnp.float32))


def test_warp_specialized_weight_gradient_in_interpreter():
  """`tgmm_ws` (lhs given as [K, M], the form JAX 0.10's interpreter can run) equals each
  group's lhs^T rhs: group boundaries inside a row block (masked in shared memory), an empty
  group in the middle and one at the end (zero), rows past the groups left out."""
  rng = np.random.default_rng(7)
  sizes = [70, 0, 100, 50, 0]
  lhs = rng.standard_normal((256, 128))
  rhs = rng.standard_normal((256, 128))
  lhs16, rhs16 = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
  out = kernel_ws.tgmm_ws(lhs16.T, rhs16, jnp.asarray(sizes, jnp.int32),
                       blocks=kernel_ws.WSBlocks(64, 64, 64, 2, 2, 32), interpret=True,
                       num_sms=3, lhs_transposed=True)
  a, b = np.asarray(lhs16, np.float64), np.asarray(rhs16, np.float64)
  ends = np.cumsum(sizes)
  exact = np.stack([a[e - s:e].T @ b[e - s:e] for s, e in zip(sizes, ends)])
  assert out.shape == (5, 128, 128) and out.dtype == jnp.bfloat16
  assert_bf16_rounding_of(out, exact)
  assert not np.any(np.asarray(out[1])) and not np.any(np.asarray(out[4]))

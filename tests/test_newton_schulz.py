"""Newton-Schulz (pallas_kernels/newton_schulz): the reference vs optax; the Pallas kernels
(interpret mode: the fused TPU kernel and the split GPU kernels) and the plain-XLA Gram form
vs the reference on awkward shapes, float32 and bf16; singular values; the dispatcher's
rule; Triton lowering for CUDA; Mosaic compilation for a v5p slice (AOT, libtpu)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import rel
from pallas_kernels.newton_schulz import (COEFFS, gram_matrix_polynomial, newton_schulz,
                                          newton_schulz_gpu, newton_schulz_reference,
                                          tpu_block_bytes, uses_gram_kernel)
from pallas_kernels.newton_schulz.gram import split_bf16

RTOL_FP32 = 1e-5  # relative Frobenius error, float32 inputs
RTOL_BF16 = 1e-2  # bf16 inputs (both sides see the same bf16 values)
# max |singular value difference| on blocks of condition number 100. The Gram form's float32
# error grows like cond^2 * 2^-24 (X X^T squares it; ~1e-4 measured here), the standard
# form's like cond * 2^-24; bf16 outputs round at 2^-9.
SV_TOL = {jnp.float32: 1e-3, jnp.bfloat16: 1e-2}
NS5_BAND = (0.6, 1.25)  # where 5 quintic steps leave singular values not near zero
TRITON_CALL = "__gpu$xla.gpu.triton"

KERNELS = {
    "tpu_interpret": functools.partial(newton_schulz, backend="interpret"),
    "gpu_interpret": functools.partial(newton_schulz_gpu, interpret=True, tile_n=32),
    "gpu_interpret_whole": functools.partial(newton_schulz_gpu, interpret=True, tile_n=32,
                                             iterate="whole"),
    "gram_reference": functools.partial(newton_schulz, backend="gram_reference"),
}
# Ragged batch counts, n off every tile, m > n (transposed inside), two leading dims.
SHAPES = [(3, 16, 200), (2, 3, 100, 24)]
reference = jax.jit(newton_schulz_reference)


def blocks(seed, shape, dtype=jnp.float32, cond=None):
  """Random blocks; with cond, each block's singular values are log-spaced from 1 down to
  1 / cond (a momentum-like spectrum instead of a Gaussian's flat one)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  if cond is not None:
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    s = np.logspace(0, -np.log10(cond), min(shape[-2:]))
    x = (u * s[..., None, :]) @ vt
  return jnp.asarray(x, dtype)


def singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def test_reference_matches_optax():
  """A 2-D block, both orientations (same eps), and a [L, H, m, n] stack against optax with
  L and H as batch axes."""
  contrib = optax.contrib
  orthogonalize = contrib._muon.orthogonalize_via_newton_schulz
  for shape in [(24, 80), (80, 24)]:
    x = blocks(0, shape)
    want = orthogonalize(x, jnp.asarray(COEFFS), 5, eps=1e-8)
    assert rel(newton_schulz_reference(x, eps=1e-8), want) < RTOL_FP32
  x = blocks(1, (2, 3, 16, 48))
  dims = contrib.MuonDimensionNumbers(reduction_axis=2, output_axis=3)
  want = orthogonalize(x, jnp.asarray(COEFFS), 5, eps=1e-7, dimension_numbers=dims)
  assert rel(reference(x), want) < RTOL_FP32


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(name, dtype):
  tol = RTOL_FP32 if dtype == jnp.float32 else RTOL_BF16
  for i, shape in enumerate(SHAPES):
    x = blocks(i, shape, dtype)
    out = jax.jit(KERNELS[name])(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, reference(x)) < tol, (name, shape)


@pytest.mark.parametrize("name", ["tpu_interpret", "gpu_interpret_bf16x3"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_singular_values_match(name, dtype):
  """Ill-conditioned blocks (condition 100): every singular value of the kernel's output is
  within SV_TOL of the reference's, and the reference's lie in the NS5 band (the GPU
  kernels' default fp16 iteration: `test_fp16_iteration_is_tf32_precise`)."""
  x = blocks(7, (2, 16, 96), dtype, cond=100.0)
  kernel = KERNELS[name] if name in KERNELS else functools.partial(
      newton_schulz_gpu, interpret=True, tile_n=32, iterate_precision="bf16x3")
  out, ref = jax.jit(kernel)(x), reference(x)
  for o, r in zip(out, ref):
    sv_out, sv_ref = singular_values(o), singular_values(r)
    assert NS5_BAND[0] < sv_ref.min() and sv_ref.max() < NS5_BAND[1]
    assert np.max(np.abs(sv_out - sv_ref)) < SV_TOL[dtype]


def _tf32(u):
  """float32 u with its mantissa rounded to tf32's 10 bits (nearest): a tf32 operand."""
  bits = jax.lax.bitcast_convert_type(u, jnp.uint32)
  bits = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def test_fp16_iteration_is_tf32_precise():
  """The GPU kernels' default [m, m] iteration (fp16 operands, float32 accumulation) is as
  close to the reference as the same Gram form iterated on tf32 operands (emulated: the
  arithmetic of a float32 matmul on NVIDIA tensor cores at default precision) on
  ill-conditioned bf16 blocks: relative error and singular values within 10%. Both sit
  at the accuracy of plain bf16 Newton-Schulz here (~6e-2; bf16x3 is ~200x closer,
  `test_singular_values_match`)."""
  x = blocks(7, (2, 16, 96), jnp.bfloat16, cond=100.0)
  ref = reference(x)
  fp16 = jax.jit(functools.partial(newton_schulz_gpu, interpret=True, tile_n=32))(x)
  tf32_dot = lambda u, v: jnp.matmul(_tf32(u), _tf32(v), precision="highest")
  gram = jnp.einsum("bmn,bkn->bmk", x, x, preferred_element_type=jnp.float32)
  q = jax.vmap(functools.partial(gram_matrix_polynomial, dot=tf32_dot))(gram)
  hi, lo = split_bf16(q)
  tf32 = sum(jnp.einsum("bmk,bkn->bmn", part, x, preferred_element_type=jnp.float32)
             for part in (lo, hi)).astype(jnp.bfloat16)

  def sv_error(out):
    return max(np.max(np.abs(singular_values(o) - singular_values(r))) for o, r in zip(out, ref))

  assert rel(fp16, ref) < 1.1 * rel(tf32, ref)
  assert sv_error(fp16) < 1.1 * sv_error(tf32)


def test_zero_block_stays_finite():
  """eps keeps an all-zero block (e.g. a head with no gradient yet) at zero, not NaN."""
  x = jnp.zeros((2, 16, 64), jnp.float32).at[1].set(blocks(3, (16, 64)))
  for name in ["tpu_interpret", "gpu_interpret"]:
    out = np.asarray(KERNELS[name](x))
    assert np.all(out[0] == 0) and np.all(np.isfinite(out))
    assert rel(out[1], reference(x[1])) < RTOL_FP32


def test_dispatch():
  """The auto rule; on CPU "auto" and "reference" are the standard form (the oracle for
  float32); "kernel" on CPU interprets the TPU kernel; an old name is told its new one."""
  assert uses_gram_kernel((128, 7168)) and uses_gram_kernel((7168, 128))
  assert not uses_gram_kernel((1536, 2048)) and not uses_gram_kernel((4096, 16384))
  assert not uses_gram_kernel((128, 256))  # not wide enough to pay
  x = blocks(4, (2, 16, 80))
  ref = reference(x)
  standard = jax.jit(functools.partial(newton_schulz, backend="reference"))
  np.testing.assert_array_equal(standard(x), ref)
  cpu_auto = jax.jit(newton_schulz).lower(x).as_text()  # 3 matmuls per step, no kernel
  assert cpu_auto.count("dot_general") == 3 * 5 and "custom_call" not in cpu_auto
  assert rel(newton_schulz(x, backend="kernel"), ref) < RTOL_FP32
  with pytest.raises(ValueError, match="unknown Newton-Schulz backend"):
    newton_schulz(x, backend="cuda")
  with pytest.raises(ValueError, match="'pallas' was renamed 'kernel'"):
    newton_schulz(x, backend="pallas")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_gpu_lowering_uses_triton(dtype):
  """Lowered for CUDA (no GPU needed), "auto" calls the Triton kernels for short-wide blocks
  (odd sizes padded inside) and none for square ones: bf16 from 64 blocks one kernel for
  everything ("whole"), fewer blocks Gram, iteration and apply kernels; float32 Gram and
  apply kernels with the iteration in XLA."""
  def lowered(shape):
    spec = jax.ShapeDtypeStruct(shape, dtype)
    f = jax.jit(newton_schulz).trace(spec).lower(lowering_platforms=("cuda",))
    return f.as_text()

  assert lowered((96, 128, 7168)).count(TRITON_CALL) == (1 if dtype == jnp.bfloat16 else 2)
  assert lowered((3, 700, 40)).count(TRITON_CALL) == (3 if dtype == jnp.bfloat16 else 2)
  assert TRITON_CALL not in lowered((4, 256, 256))


def test_gpu_iterate_precision():
  """gpu_iterate picks the Triton iteration's precision for bf16 blocks (the lowered kernels
  differ; float32 blocks iterate at HIGHEST either way), and the fp16 and bf16x3 iterations
  equal the reference in interpret mode; an unknown name is refused."""
  def lowered(dtype, gpu_iterate):
    spec = jax.ShapeDtypeStruct((96, 128, 1024), dtype)
    f = functools.partial(newton_schulz, gpu_iterate=gpu_iterate)
    return jax.jit(f).trace(spec).lower(lowering_platforms=("cuda",)).as_text()

  assert lowered(jnp.bfloat16, "fp16") != lowered(jnp.bfloat16, "bf16x3")
  assert lowered(jnp.float32, "fp16") == lowered(jnp.float32, "bf16x3")
  x = blocks(5, (3, 16, 200), jnp.bfloat16)
  for name in ("fp16", "bf16x3"):
    out = newton_schulz_gpu(x, interpret=True, tile_n=32, iterate="whole",
                            iterate_precision=name)
    assert rel(out, reference(x)) < RTOL_BF16, name
  with pytest.raises(ValueError, match="bf16x3"):
    newton_schulz(x, gpu_iterate="bf16")


def test_tpu_aot_compile():
  """The Mosaic kernel compiles for a v5p 2x2x1 slice with the blocks sharded over the 4
  chips and each orthogonalized where it lives (no collective), and "auto" picks it there
  for short-wide blocks only."""
  from tpu_aot import tpu_mesh  # noqa: PLC0415
  mesh = tpu_mesh(("heads",))
  sharding = NamedSharding(mesh, P("heads"))
  f = jax.jit(jax.shard_map(newton_schulz, mesh=mesh, in_specs=P("heads"),
                            out_specs=P("heads")))
  for shape, dtype in [((8, 128, 7168), jnp.bfloat16), ((4, 2, 300, 40), jnp.float32)]:
    lowered = f.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    hlo = compiled.as_text()
    assert not any(op in hlo for op in ("all-gather", "all-reduce", "all-to-all"))
    # Arguments and outputs: one chip's quarter, at most doubled by the TPU's tiled layout
    # of small dims; temporaries: at most padded copies of the chip's blocks.
    memory = compiled.memory_analysis()
    local_bytes = np.prod(shape) // 4 * jnp.dtype(dtype).itemsize
    local_blocks = np.prod(shape[:-2]) // 4
    assert local_bytes <= memory.argument_size_in_bytes < 2 * local_bytes
    assert local_bytes <= memory.output_size_in_bytes < 2 * local_bytes
    assert memory.temp_size_in_bytes <= 4 * local_blocks * tpu_block_bytes(shape, dtype)
  square = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32, sharding=sharding)
  assert "tpu_custom_call" not in f.lower(square).as_text()

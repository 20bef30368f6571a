"""What the KDA Pallas kernels share: their settings (`Config`), the pallas_call of each
backend, and how per-token arrays are laid out and cut into blocks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one call (hashable: a custom_vjp non-differentiable argument)."""
  scale: float
  chunk: int  # C
  sub: int  # diagonal sub-tile length L
  block_v: int  # BV
  mm_dtype: str  # operand dtype of the big matmuls: "bfloat16" or "float32"
  interpret: bool
  platform: str  # "gpu", "tpu" or "cpu" (interpret)
  save_states: bool = True  # False: the backward reruns rec_fwd for the chunk states
  # The sequence's recurrences in this many spans run in parallel, joined through each
  # span's transition (`spans.py`; GPU and interpret mode, a power of two dividing the
  # chunks).
  spans: int = 1
  # Rows of a span's [K + V, K] transition per program (`spans.transitions`); 128 was the
  # fastest of 16-128 on the H200 (benchmarks/results/kda.md)
  transition_block: int = 128
  # V columns per program of the chain through the spans ([BV, K] x [K, K] fp32 products);
  # 16 was the fastest on the H200 (benchmarks/results/kda.md)
  chain_block: int = 16
  prep_warps: int = 4  # faster than 8 on the H200 (benchmarks/results/kda.md)
  # GPU fp32 matmuls of prep ("tf32x3", "tf32" or "ieee"): single-pass TF32 is faster than
  # tf32x3 on the H200 with the same errors against the fp32 reference
  # (benchmarks/results/kda.md)
  prep_precision: str = "tf32"
  # Triton pipelining stages of the recurrences' chunk loop (the next chunk's loads overlap
  # this one's products); 3 was the fastest on the H200 (benchmarks/results/kda.md)
  rec_stages: int = 3
  rec_warps: int = 4  # the recurrences' warps per program (GPU)
  # rec_fwd when it saves the chunk states (the training forward; GPU): its own V block and
  # warps, 0 for block_v and rec_warps. On the H200 V blocks of 32 at 2 warps beat 64 at 4
  # for the state-saving forward; rec_bwd and the stateless forward gain nothing from it
  # (benchmarks/results/kda.md).
  states_block_v: int = 0
  states_warps: int = 0
  # chunk_cots (GPU): 4 warps faster than 8 on the H200 though it spills registers at 4
  # (kernel_resources.py; benchmarks/results/kda.md)
  cots_warps: int = 4
  # chunk_bwd: 8 warps (no register spill) is the fastest on the H200, also when it held
  # chunk_cots' work (benchmarks/results/kda.md)
  bwd_warps: int = 8
  # chunk_bwd's fp32 matmuls (prep recomputed, its vjp): tf32 is the fastest on the H200,
  # with gradients as accurate as tf32x3 and ieee (benchmarks/results/kda.md)
  bwd_precision: str = "tf32"

  @property
  def precision(self):
    """Precision of float32 matmuls: 3-pass TF32 on GPU tensor cores, else full fp32."""
    return self._gpu_precision("tf32x3")

  @property
  def prep_prec(self):
    """Precision of the prep kernel's float32 matmuls (tunable on GPU)."""
    return self._gpu_precision(self.prep_precision)

  @property
  def bwd_prec(self):
    """Precision of chunk_bwd's float32 matmuls (prep recomputed and its vjp)."""
    return self._gpu_precision(self.bwd_precision)

  def _gpu_precision(self, name):
    """The named GPU algorithm ("tf32x3", "tf32", "ieee") on GPU; HIGHEST elsewhere."""
    if self.platform == "gpu" and not self.interpret:
      return {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
              "ieee": lax.DotAlgorithmPreset.F32_F32_F32}[name]
    return lax.Precision.HIGHEST

  @property
  def mm(self):
    return jnp.dtype(self.mm_dtype)


def call(cfg, kernel, **kw):
  """pl.pallas_call with the backend's compiler parameters (TPU: every grid axis parallel;
  GPU: num_warps, num_stages from kw)."""
  if cfg.platform == "tpu" and not cfg.interpret:
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    n = len(kw["grid"])
    kw["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel",) * n)
    kw.pop("num_warps", None)
  elif cfg.platform == "gpu" and not cfg.interpret:
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    kw["compiler_params"] = plgpu.CompilerParams(num_warps=kw.pop("num_warps", 4),
                                                 num_stages=kw.pop("num_stages", 1))
  else:
    kw.pop("num_warps", None)
  kw.pop("num_stages", None)
  return pl.pallas_call(kernel, interpret=cfg.interpret, **kw)


def heads_major(platform):
  """The kernels' layout of per-token arrays: [B, H, Tp, D] on TPU (Mosaic tiles the last two
  block dims, so a block must be a head's rows), else the callers' [B, Tp, H, D], which
  saves a transpose of every input and gradient, a measurable share of the GPU step
  (benchmarks/results/kda.md)."""
  return platform == "tpu"


def token_shape(cfg, B, H, Tp, d):
  """The shape of a per-token array of d columns in the kernels' layout."""
  return (B, H, Tp, d) if heads_major(cfg.platform) else (B, Tp, H, d)


def dims(cfg, x):
  """(B, H, Tp, D) of a per-token array in the kernels' layout."""
  if heads_major(cfg.platform):
    return x.shape
  B, Tp, H, D = x.shape
  return B, H, Tp, D


def tokens(cfg, rows, cols, index):
  """BlockSpec of `rows` tokens x `cols` columns of one (batch row, head) of a per-token
  array in the kernels' layout; index(*program ids) -> (b, h, row block, column block)."""
  if heads_major(cfg.platform):
    return pl.BlockSpec((None, None, rows, cols), index)

  def seq_major(*ids):
    b, h, t, c = index(*ids)
    return b, t, h, c
  return pl.BlockSpec((None, rows, None, cols), seq_major)


def chunk_specs(cfg, K):
  """BlockSpecs of one chunk per program, grid (B, H, N): (per-token [.., C, d] of d
  columns, per-token column [B, Tp, 1], the chunk's document row [B, N, 1, C], the chunk's
  decay row [B, H, N, 1, K])."""
  C = cfg.chunk
  tok = lambda d: tokens(cfg, C, d, lambda b, h, n: (b, h, n, 0))
  col = pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0))
  row = pl.BlockSpec((None, None, 1, C), lambda b, h, n: (b, n, 0, 0))
  dec = pl.BlockSpec((None, None, None, 1, K), lambda b, h, n: (b, h, n, 0, 0))
  return tok, col, row, dec

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
  # Rows of a span's [K + V, K] transition per program (`spans.transitions`). H200,
  # (1, 32768, 16, 128) in 8 spans (results/kda.md, session 12): 0.49 ms at 128, 0.65 at 64,
  # 0.72 at 32, 1.22 at 16
  transition_block: int = 128
  # V columns per program of the chain through the spans ([BV, K] x [K, K] fp32 products):
  # 0.05 ms at 16, 0.14 at 64 over 8 spans at (1, 32768, 16, 128) (session 12)
  chain_block: int = 16
  prep_warps: int = 4  # measured on the H200: 4 warps twice as fast as 8
  # GPU fp32 matmuls of prep ("tf32x3", "tf32" or "ieee"). H200 (8, 4096, 16, 128), chunk 16,
  # fp32 gate: prep 0.80 ms at tf32, 1.24 at tf32x3; errors against the fp32 reference equal
  # to two digits at chunks 16 and 32 (results/kda.md, session 9)
  prep_precision: str = "tf32"
  # Triton pipelining stages of the recurrences' chunk loop (the next chunk's loads overlap
  # this one's products). H200, rec_bwd at (1, 32768, 16, 128): 3.99 ms at 1, 2.15 at 3
  rec_stages: int = 3
  rec_warps: int = 4  # the recurrences' warps per program (GPU)
  # rec_fwd when it saves the chunk states (the training forward; GPU): its own V block and
  # warps, 0 for block_v and rec_warps. H200 (results/kda.md, session 11): V blocks of 32
  # at 2 warps 2.90 ms against 3.17 at 64 / 4 at (2, 8192, 96, 128), 0.76 vs 0.88 at
  # (8, 4096, 16, 128); rec_bwd and the stateless forward gain nothing from it.
  states_block_v: int = 0
  states_warps: int = 0
  # chunk_cots (GPU). H200, (8, 4096, 16, 128): 1.38 ms at 4 warps, 1.89 at 8, though at 4
  # it spills 184 bytes a thread (kernel_resources.py)
  cots_warps: int = 4
  # chunk_bwd, H200 (8, 4096, 16, 128): 3.66 ms at 8 warps (227 registers, no spill), 3.71
  # at 4 (session 10); with chunk_cots' work inside it, 6.1 at 8, 14.2 at 4, 30.5 at 16
  bwd_warps: int = 8
  # chunk_bwd's fp32 matmuls (prep recomputed, its vjp). H200 (8, 4096, 16, 128), 8 warps:
  # 5.33 ms at tf32, 6.32 at tf32x3, 8.87 at ieee; gradients as accurate (session 9)
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
  saves a transpose of every input and gradient (H200, (8, 4096, 16, 128): 0.47 of 1.81 ms
  forward, 0.97 of 8.69 forward + backward, results/kda.md, session 10)."""
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

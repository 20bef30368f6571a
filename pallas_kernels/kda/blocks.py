"""The KDA kernels' settings (`Config`), pallas_call per backend, per-token layout and blocks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one call (hashable). GPU tuning defaults: benchmarks/results/kda.md;
  states_*: rec_fwd's when it saves states (0: block_v, rec_warps)."""
  scale: float
  chunk: int  # C
  sub: int  # diagonal sub-tile length L
  block_v: int
  mm_dtype: str  # operand dtype of the big matmuls: "bfloat16" or "float32"
  interpret: bool
  platform: str
  save_states: bool = True
  save_inverse: bool = True  # under autodiff prep writes (I + A_kk)^-1 and s_kk for chunk_bwd
  bounded_gate: bool = True  # g >= LOWER_BOUND; False: `tile.pair_part`s on the diagonal
  spans: int = 1  # recurrences in parallel spans (`spans.py`), a power of two
  transition_block: int = 128
  chain_block: int = 16
  prep_warps: int = 4
  prep_precision: str = "tf32"
  rec_stages: int = 3
  rec_warps: int = 4
  states_block_v: int = 0
  states_warps: int = 0
  cots_warps: int = 4
  bwd_warps: int = 8
  bwd_precision: str = "tf32"

  @property
  def precision(self):
    """fp32 matmuls: 3-pass TF32 on GPU, else HIGHEST."""
    return self._gpu_precision("tf32x3")

  @property
  def prep_prec(self):
    return self._gpu_precision(self.prep_precision)

  @property
  def bwd_prec(self):
    return self._gpu_precision(self.bwd_precision)

  def _gpu_precision(self, name):
    if self.platform == "gpu" and not self.interpret:
      return {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
              "ieee": lax.DotAlgorithmPreset.F32_F32_F32}[name]
    return lax.Precision.HIGHEST

  @property
  def mm(self):
    return jnp.dtype(self.mm_dtype)


def call(cfg, kernel, **kw):
  """pl.pallas_call with the backend's compiler params (GPU: num_warps, num_stages in kw)."""
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
  """[B, H, Tp, D] on TPU (Mosaic tiles a block's last two dims: one head's rows), else the
  callers' [B, Tp, H, D], saving a transpose of every input and gradient."""
  return platform == "tpu"


def token_shape(cfg, B, H, Tp, d):
  return (B, H, Tp, d) if heads_major(cfg.platform) else (B, Tp, H, d)


def dims(cfg, x):
  if heads_major(cfg.platform):
    return x.shape
  B, Tp, H, D = x.shape
  return B, H, Tp, D


def tokens(cfg, rows, cols, index):
  """BlockSpec of rows x cols of one (b, h); index(*program ids) -> (b, h, row blk, col blk)."""
  if heads_major(cfg.platform):
    return pl.BlockSpec((None, None, rows, cols), index)

  def seq_major(*ids):
    b, h, t, c = index(*ids)
    return b, t, h, c
  return pl.BlockSpec((None, rows, None, cols), seq_major)


def chunk_specs(cfg, K):
  """Grid (B, H, N) specs: (per-token, of d columns; [B, Tp, 1]; [B, N, 1, C]; [B, H, N, 1, K])."""
  C = cfg.chunk
  tok = lambda d: tokens(cfg, C, d, lambda b, h, n: (b, h, n, 0))
  col = pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0))
  row = pl.BlockSpec((None, None, 1, C), lambda b, h, n: (b, n, 0, 0))
  dec = pl.BlockSpec((None, None, None, 1, K), lambda b, h, n: (b, h, n, 0, 0))
  return tok, col, row, dec

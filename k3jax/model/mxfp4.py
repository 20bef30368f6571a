"""MXFP4 as the released Kimi K3 stores its routed experts (compressed-tensors'
`mxfp4-pack-quantized`): a weight [..., N] becomes packed uint8 [..., N / 2] (two E2M1
codes a byte, even column low; code = sign bit 8 | index) and scales uint8 [..., N / 32]
(E8M0; 255 refused): value = E2M1_VALUES[code & 7] * (-1 if code & 8) * 2^(scale - 127).

`quantize` follows compressed-tensors' rule on the bf16 weight: scale = p / 4 for the
group amax rounded to a power of two p, values to the nearest E2M1 (ties even, saturating
at 6); on-grid weights round-trip. NumPy codec for import/export; `dequantize_jax` decodes
on a device (the import); `fake_quantize` is the quantization rule in JAX for QAT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2    # 0.25, 0.75, ..., 5
_SIGN = np.uint8(8)
NAN_SCALE = 255


def _code_values() -> np.ndarray:
  magnitude = np.concatenate([E2M1_VALUES, E2M1_VALUES])
  return np.where(np.arange(16) & 8, -magnitude, magnitude).astype(np.float32)


# each byte's two float32 values as one 8-byte word: one lookup per byte
_BYTE_VALUES = np.stack([_code_values()[np.arange(256) & 0xF],
                         _code_values()[np.arange(256) >> 4]], axis=-1).view(np.uint64)[:, 0]


def unpack_codes(packed: np.ndarray) -> np.ndarray:
  """uint8 [..., N / 2] -> the E2M1 codes uint8 [..., N], low nibble first."""
  packed = np.asarray(packed, np.uint8)
  return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def pack_codes(codes: np.ndarray) -> np.ndarray:
  """E2M1 codes uint8 [..., N] (N even) -> uint8 [..., N / 2], the even column low."""
  codes = np.asarray(codes, np.uint8)
  if codes.shape[-1] % 2:
    raise ValueError(f"MXFP4 packs pairs of columns; got {codes.shape[-1]} columns")
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _groups(shape, n: int) -> int:
  if n % GROUP:
    raise ValueError(f"MXFP4 groups {GROUP} columns; {n} columns (shape {tuple(shape)}) "
                     f"are not a multiple")
  return n // GROUP


def dequantize(packed: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
  """packed [..., N / 2], scales [..., N / 32] uint8 -> [..., N] in `dtype` (exact)."""
  packed = np.asarray(packed, np.uint8)
  shape = (*packed.shape[:-1], 2 * packed.shape[-1])
  n = shape[-1]
  scales = np.asarray(scales, np.uint8)
  if scales.shape != (*shape[:-1], _groups(shape, n)):
    raise ValueError(f"MXFP4 scales of shape {scales.shape} do not fit packed weights "
                     f"{packed.shape} ({n} columns: {n // GROUP} scales a row)")
  check_scales(scales)
  values = np.take(_BYTE_VALUES, packed).view(np.float32).reshape(*shape[:-1], -1, GROUP)
  factors = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)
  np.multiply(values, factors[..., None], out=values)   # in place: no second large array
  return values.reshape(shape).astype(dtype, copy=False)


def check_scales(scales: np.ndarray) -> None:
  if (scales == NAN_SCALE).any():
    raise ValueError("MXFP4 scale 255 (E8M0 NaN) in the scales")


def _value_bits() -> np.ndarray:
  """uint32 [256 scales, 16 codes]: float32 bits of each value, subnormals exact, past
  float32's range inf (as `dequantize` gives)."""
  with np.errstate(over="ignore"):
    values = np.ldexp(_code_values().astype(np.float64)[None, :], np.arange(256)[:, None] - 127)
    return values.astype(np.float32).view(np.uint32)


# a gather from this table: no arithmetic for a device's flush-to-zero to touch
_VALUE_BITS = _value_bits().reshape(-1)


@jax.jit
def dequantize_jax(packed: jax.Array, scales: jax.Array) -> jax.Array:
  """`dequantize` on packed's device: uint8 [..., N / 2], [..., N / 32] -> float32 [..., N]."""
  n = 2 * packed.shape[-1]
  codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1],
                                                                   n // GROUP, GROUP)
  index = scales.astype(jnp.int32)[..., None] * 16 + codes
  bits = jnp.asarray(_VALUE_BITS)[index]
  return jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(*packed.shape[:-1], n)


def group_scales(amax_bf16: np.ndarray) -> np.ndarray:
  """Group amax (bf16 values) -> E8M0 scale byte 127 + log2(p) - 2, clipped to [0, 254]."""
  bits = np.asarray(amax_bf16, np.float32).view(np.uint32) >> 16      # bf16 bit pattern
  exponent_field = ((bits + 0x20) & 0x7F80) >> 7                       # + 0.25 ulp of 1.0
  scale = exponent_field.astype(np.int64) - 2
  return np.where(bits == 0, 0, np.clip(scale, 0, 254)).astype(np.uint8)


def to_bf16_values(x: np.ndarray) -> np.ndarray:
  """float32 values rounded to bf16 (nearest, ties to even), kept in float32."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
  return rounded.astype(np.uint32).view(np.float32)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [..., N], N % 32 == 0 -> (packed uint8 [..., N / 2], scales uint8 [..., N / 32])."""
  w = np.asarray(w, np.float32)
  if not np.isfinite(w).all():
    raise ValueError("MXFP4 cannot encode inf or NaN weights")
  n = w.shape[-1]
  g = _groups(w.shape, n)
  w = to_bf16_values(w).reshape(*w.shape[:-1], g, GROUP)
  scales = group_scales(np.abs(w).max(axis=-1))
  scaled = np.abs(np.ldexp(w.astype(np.float64), 127 - scales[..., None].astype(np.int32)))
  index = np.searchsorted(_MIDPOINTS, scaled, side="left")             # 0..7, past 5 -> 7
  tie = (index < len(_MIDPOINTS)) & (scaled == _MIDPOINTS[np.minimum(index, 6)])
  index = np.where(tie & (index % 2 == 1), index + 1, index).astype(np.uint8)
  codes = np.where((w < 0) & (index > 0), index | _SIGN, index).astype(np.uint8)
  return pack_codes(codes.reshape(*codes.shape[:-2], n)), scales


def fake_quantize(w: jax.Array, axis: int = -2) -> jax.Array:
  """w on the MXFP4 grid (groups of 32 along `axis`), straight-through gradient; bit-equal
  to `dequantize(*quantize(.))` for group scales in [1, 253]."""
  x = jnp.moveaxis(w, axis, -1).astype(jnp.float32)
  n = x.shape[-1]
  g = _groups(x.shape, n)
  x = x.astype(jnp.bfloat16).astype(jnp.float32).reshape(*x.shape[:-1], g, GROUP)
  amax_bits = jax.lax.bitcast_convert_type(jnp.max(jnp.abs(x), axis=-1), jnp.uint32) >> 16
  exponent_field = (((amax_bits + 0x20) & 0x7F80) >> 7).astype(jnp.int32)
  scale = jnp.where(amax_bits == 0, 0, jnp.clip(exponent_field - 2, 0, 254))[..., None]
  power = lambda e: jax.lax.bitcast_convert_type(  # noqa: E731  2^e, e in [-126, 127]
      ((e + 127) << 23).astype(jnp.uint32), jnp.float32)
  scaled = jnp.abs(x) * power(127 - scale)
  midpoints = jnp.asarray(_MIDPOINTS)
  index = jnp.sum(scaled[..., None] > midpoints, axis=-1)             # ties: the lower
  tie = jnp.any(scaled[..., None] == midpoints, axis=-1)
  index = jnp.where(tie & (index % 2 == 1), index + 1, index)         # ties to even codes
  q = jnp.sign(x) * jnp.asarray(E2M1_VALUES)[index] * power(scale - 127)
  q = jnp.moveaxis(q.reshape(*x.shape[:-2], n), -1, axis).astype(w.dtype)
  return (w - jax.lax.stop_gradient(w)) + jax.lax.stop_gradient(q)

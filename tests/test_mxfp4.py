"""k3jax.model.mxfp4, the release's MXFP4 codec, against hand-computed values: every E2M1
code, the nibble order, scale extremes, the scale rule, ties and saturation, and the
round trip of weights already on the grid."""

import numpy as np
import pytest

from k3jax.model import mxfp4

# code -> value, from the E2M1 layout (sign, 2 exponent bits, 1 mantissa bit)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def one_group(codes, scale):
  """A row of 32 codes (padded with code 0) and one scale byte, packed."""
  codes = np.asarray(list(codes) + [0] * (32 - len(codes)), np.uint8)[None]
  return mxfp4.pack_codes(codes), np.asarray([[scale]], np.uint8)


def test_every_code_and_the_nibble_order():
  """Codes 0..15 at scale 127 (x 1) read as the E2M1 table; byte 0x71 holds code 1 in the
  even (low) and code 7 in the odd (high) column."""
  packed, scales = one_group(range(16), 127)
  got = mxfp4.dequantize(packed, scales)[0]
  np.testing.assert_array_equal(got[:16], E2M1)
  assert np.signbit(got[8]) and not got[16:].any()
  assert packed[0, 0] == 0x10 and packed[0, 7] == 0xFE     # codes (0, 1) and (14, 15)
  np.testing.assert_array_equal(mxfp4.unpack_codes(np.asarray([[0x71]], np.uint8)), [[1, 7]])


@pytest.mark.parametrize("scale, factor", [(0, 2.0 ** -127), (1, 2.0 ** -126), (127, 1.0),
                                           (128, 2.0), (254, 2.0 ** 127)])
def test_scale_extremes(scale, factor):
  """2^(scale - 127) from the smallest (times 0.5: a float32 subnormal) to the largest
  (times 1.5: below float32's largest)."""
  packed, scales = one_group([1, 3, 11], scale)
  got = mxfp4.dequantize(packed, scales)[0, :3]
  np.testing.assert_array_equal(got, np.float32([0.5 * factor, 1.5 * factor, -1.5 * factor]))
  assert np.isfinite(got).all() and got[0] > 0


def test_the_device_decode_is_bit_equal_for_every_code_and_scale():
  """dequantize_jax (the import's decode on the device) against the NumPy codec: all 16
  codes at all 255 scales, bit for bit: subnormals (scales 0, 1) and the overflow to inf
  (6 x 2^127) included, though devices flush subnormal arithmetic to zero."""
  codes = np.tile(np.arange(16, dtype=np.uint8), 2)[None].repeat(255, axis=0)   # [255, 32]
  packed, scales = mxfp4.pack_codes(codes), np.arange(255, dtype=np.uint8)[:, None]
  with np.errstate(over="ignore"):
    want = mxfp4.dequantize(packed, scales)
  got = np.asarray(mxfp4.dequantize_jax(packed, scales))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  assert np.isinf(want).any() and (np.abs(want[0][want[0] != 0]) < 2.0 ** -126).any()


def test_nan_scale_and_bad_shapes_are_refused():
  packed, scales = one_group([1], 255)
  with pytest.raises(ValueError, match="255"):
    mxfp4.dequantize(packed, scales)
  with pytest.raises(ValueError, match="do not fit"):
    mxfp4.dequantize(packed, np.zeros((1, 2), np.uint8))
  with pytest.raises(ValueError, match="multiple"):
    mxfp4.quantize(np.ones((2, 48), np.float32))
  with pytest.raises(ValueError, match="NaN"):
    mxfp4.quantize(np.full((1, 32), np.nan, np.float32))


@pytest.mark.parametrize("amax, scale", [
    (6.0, 127),        # 1.5 x 4: p = 4, scale 4 / 4 = 1
    (4.0, 127),
    (6.96875, 127),    # 1.7421875 x 4 (the largest bf16 mantissa below 1.75): still down
    (7.0, 128),        # 1.75 x 4: rounds up to p = 8, scale 2
    (1.0, 125),        # p = 1, scale 1/4
    (0.0, 0),          # an all-zero group
    (2.0 ** -127, 0),  # below the smallest scale: clipped to 0
])
def test_the_scale_rule(amax, scale):
  w = np.zeros((1, 32), np.float32)
  w[0, 5] = -amax
  assert mxfp4.quantize(w)[1][0, 0] == scale


def test_ties_go_to_the_even_code_and_large_values_saturate():
  """At scale 1 (amax 6): the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to 0, 1, 1,
  2, 2, 4, 4 (even codes); just past them, up; 6.5 cannot occur at this scale, but 6.96875
  (a group maximum that keeps scale 1) saturates to 6."""
  ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
  past = [0.2578125, 0.7578125, 1.2578125, 1.7578125, 2.515625, 3.515625, 5.03125]  # bf16
  w = np.zeros((1, 32), np.float32)
  w[0, :7], w[0, 7:14], w[0, 14], w[0, 15] = ties, past, 6.96875, -5.0
  packed, scales = mxfp4.quantize(w)
  got = mxfp4.dequantize(packed, scales)[0]
  assert scales[0, 0] == 127
  np.testing.assert_array_equal(got[:7], [0, 1, 1, 2, 2, 4, 4])
  np.testing.assert_array_equal(got[7:14], [0.5, 1, 1.5, 2, 3, 4, 6])
  assert got[14] == 6 and got[15] == -4


def test_weights_on_the_grid_come_back_with_the_same_values():
  """Random codes and scales (every code, scales 1..250) dequantized, then quantized: the
  same values (a group whose largest value is below 4 gets a smaller scale and larger
  codes, so the bytes may differ, the values may not)."""
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, (6, 4, 256), dtype=np.uint8)
  scales = rng.integers(1, 251, (6, 4, 8), dtype=np.uint8)
  values = mxfp4.dequantize(mxfp4.pack_codes(codes), scales)
  again = mxfp4.dequantize(*mxfp4.quantize(values))
  np.testing.assert_array_equal(again, values)
  full = codes.copy()
  full[..., ::32] = 7                                     # every group reaches 6: same bytes
  packed = mxfp4.pack_codes(full)
  values = mxfp4.dequantize(packed, scales)
  p2, s2 = mxfp4.quantize(values)
  np.testing.assert_array_equal(s2, scales)
  np.testing.assert_array_equal(mxfp4.dequantize(p2, s2), values)


def test_weights_round_to_bf16_first():
  """The rule acts on bf16 weights: 1 + 2^-9 (between bf16 neighbours 1 and 1 + 2^-7) is
  1 in bf16, so it lands on code 1.0 exactly as 1 does."""
  assert mxfp4.to_bf16_values(np.float32([1 + 2 ** -9]))[0] == 1.0
  assert mxfp4.to_bf16_values(np.float32([1 + 3 * 2 ** -9]))[0] == 1 + 2 ** -7


def test_fake_quantize_equals_the_codec_and_passes_gradients_straight():
  """The JAX fake quantizer (QAT) = dequantize(quantize(w)) bit for bit, grouping along the
  input axis of k3jax's [experts, in, out] matrices, including exact ties and zeros; its
  gradient is the identity."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  rng = np.random.default_rng(1)
  w = (rng.standard_normal((3, 64, 24)) * rng.choice([1e-3, 1.0, 30.0], (3, 1, 24)))
  w = w.astype(np.float32)
  w[0, :32, 0] = 0.0                                              # an all-zero group
  w[1, :8, 1] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]      # exact ties at scale 1
  got = np.asarray(jax.jit(mxfp4.fake_quantize)(jnp.asarray(w)))
  in_last = np.swapaxes(w, -1, -2)
  want = np.swapaxes(mxfp4.dequantize(*mxfp4.quantize(in_last)), -1, -2)
  np.testing.assert_array_equal(got, want)
  g = jax.grad(lambda w: jnp.sum(mxfp4.fake_quantize(w) * 3.0))(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(g), np.full_like(w, 3.0))

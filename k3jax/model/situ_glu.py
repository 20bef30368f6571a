"""SiTU-GLU (K3_SPEC 4.1), SwiGLU for the ablation, and the gated MLP built on them.

  h = [b1 tanh(g/b1) * sigmoid(g)] * [b2 tanh(v/b2)],   g = x W_g,  v = x W_u,  y = h W_d

Soft caps bound |h| < b1 * b2; near 0 it equals SwiGLU to first order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model.layers import Dense
from k3jax.model.remat import keep, recomputed

ACTIVATIONS = ("situ_glu", "swiglu")


def situ_glu(g: jax.Array, v: jax.Array, b1: float = 4.0, b2: float = 25.0) -> jax.Array:
  """[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(v/b2)] in fp32. g, v: [...] -> fp32 [...]."""
  g = g.astype(jnp.float32)
  v = v.astype(jnp.float32)
  return (b1 * jnp.tanh(g / b1) * jax.nn.sigmoid(g)) * (b2 * jnp.tanh(v / b2))


def swiglu(g: jax.Array, v: jax.Array) -> jax.Array:
  """silu(g) * v in fp32. g, v: [...] -> fp32 [...]."""
  g = g.astype(jnp.float32)
  return jax.nn.silu(g) * v.astype(jnp.float32)


def glu_activation(name: str, b1: float = 4.0, b2: float = 25.0, recompute: bool = False):
  """The fp32 activation (g, v) -> h named by `config.model.ffn.activation`;
  recompute: `remat.recomputed`."""
  maybe = recomputed if recompute else (lambda fn: fn)
  if name == "situ_glu":
    return maybe(lambda g, v: situ_glu(g, v, b1, b2))
  if name == "swiglu":
    return maybe(swiglu)
  raise ValueError(f"unknown GLU activation {name!r}; known: {ACTIVATIONS}")


class GLUMLP(nnx.Module):
  """y = act(x W_g, x W_u) W_d, no biases; activation fp32, matmuls in `dtype`;
  recompute: the activation's backward recomputes it (`glu_activation`)."""

  def __init__(self, d_in: int, hidden: int, *, activation: str = "situ_glu",
               b1: float = 4.0, b2: float = 25.0, axes_in: str = "embed",
               recompute: bool = False, rngs: nnx.Rngs, dtype=jnp.bfloat16,
               param_dtype=jnp.float32):
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.w_g = Dense(d_in, hidden, (axes_in, "mlp"), **kw)
    self.w_u = Dense(d_in, hidden, (axes_in, "mlp"), **kw)
    self.w_d = Dense(hidden, d_in, ("mlp", axes_in), **kw)
    glu_activation(activation)  # a ValueError here, not at the first call
    self.activation, self.b1, self.b2 = activation, b1, b2
    self.dtype, self.recompute = dtype, recompute

  def __call__(self, x: jax.Array) -> jax.Array:
    act = glu_activation(self.activation, self.b1, self.b2, self.recompute)
    h = act(keep("glu_proj", self.w_g(x)), keep("glu_proj", self.w_u(x)))  # [..., hidden]
    return self.w_d(keep("glu_out", h.astype(self.dtype)))

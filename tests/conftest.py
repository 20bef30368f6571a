"""Test-wide settings and shared fixtures.

8 simulated CPU devices for mesh tests (set before jax loads) and a persistent
compilation cache, so that tests compiling the same program pay for it once.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (AOT TPU compiles, tests/tpu_aot.py): no GCE metadata query, and no lockfile, so
# that several pytest-xdist workers can load it at once.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import config as k3config  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("K3JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(),
                                                                  "k3jax-test-xla-cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def micro_config():
  """k3_tiny's structure at the smallest size: 13 layers = a dense-FFN first cycle, two
  scanned cycles and the final MLA; AttnRes blocks of 3 layers, so block boundaries fall
  inside the scanned cycles; fp32 throughout."""
  c = k3config.base_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers = 64, 32, 13
  m.kda.num_heads, m.kda.head_dim, m.kda.gate_rank, m.kda.chunk_size = 2, 16, 8, 16
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 2, 16, 16
  m.mla.qk_nope_dim, m.mla.qk_rope_dim, m.mla.v_head_dim = 8, 8, 16
  m.ffn.hidden_dim = 64
  m.moe.num_experts, m.moe.top_k, m.moe.expert_dim, m.moe.latent_dim = 8, 2, 32, 16
  m.moe.shared_dim = 32
  m.attn_res.block_layers = 3
  m.dtype, m.remat = "float32", "none"
  t = c.train
  t.seq_len, t.global_batch, t.steps = 32, 4, 6
  t.log_every, t.eval_every, t.eval_batches, t.checkpoint_every = 1, 3, 1, 3
  c.optimizer.warmup_steps, c.optimizer.learning_rate = 2, 1e-2
  return c


def rel(a, b) -> float:
  """||a - b|| / ||b|| in float64: the relative error every reference-vs-kernel spec uses."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def set_field(cfg, dotted: str, value):
  """cfg.a.b.c = value for dotted = "a.b.c" (the field a config-error test breaks)."""
  *parents, leaf = dotted.split(".")
  node = cfg
  for name in parents:
    node = getattr(node, name)
  setattr(node, leaf, value)
  return cfg


def jaxpr_eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside its equations' parameters (scan and
  remat bodies, custom-vjp rules, Pallas kernels), depth first."""
  from jax.extend import core as jax_core  # noqa: PLC0415
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
          yield from jaxpr_eqns(getattr(sub, "jaxpr", sub))


def random_model(cfg_model, seed: int = 0, model_cls=None):
  """A model whose every variable is random (numpy; no XLA init compile): gains near 1,
  matrices ~ 1/sqrt(fan-in), AttnRes queries and balancing biases non-zero so that
  they matter in the tests."""
  from k3jax.model import K3Model  # noqa: PLC0415
  cls = model_cls or K3Model
  abstract = nnx.eval_shape(lambda: cls(cfg_model, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)

  def fill(x):
    if x.ndim == 0:
      return jnp.zeros(x.shape, x.dtype)
    if x.ndim == 1:  # gains and biases
      return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-2]), x.dtype)

  return nnx.merge(graphdef, jax.tree.map(fill, state))


def ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name, axis_index_groups=None):
  """`jax.lax.ragged_all_to_all` as its docstring defines it, from all-gathers (XLA:CPU has
  no ragged all-to-all): every peer's slices for this device, written where the sender's
  output_offsets say. Tests monkeypatch it in to check a dispatch's offsets and sizes."""
  assert axis_index_groups is None
  peers = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  per_peer = input_offsets.shape[0] // peers
  ops, starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in (
      operand, input_offsets, send_sizes, output_offsets))
  pos = jnp.arange(output.shape[0])
  del recv_sizes  # implied by the senders' send_sizes
  for src in range(peers):
    for j in range(per_peer):
      i = me * per_peer + j
      start, size, dest = starts[src, i], sizes[src, i], dests[src, i]
      rows = jnp.take(ops[src], jnp.clip(pos - dest + start, 0, operand.shape[0] - 1), axis=0)
      inside = ((pos >= dest) & (pos < dest + size)).reshape((-1,) + (1,) * (output.ndim - 1))
      output = jnp.where(inside, rows, output)
  return output

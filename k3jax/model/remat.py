"""What a rematerialized region keeps for its backward: `model.remat` and `model.remat_save`.

`model.remat` is the base policy of each region (a scanned cycle; each layer too with
`remat_scope="layer"`). `model.remat_save` names values kept on top of it: the model tags
them with `keep(name, x)`; each costs a matmul or a kernel to recompute and little to hold.
"elementwise" sets no region: autodiff keeps what it needs, except that the GLU activations
are `recomputed` from their bf16 inputs (XLA would keep fp32 values of their tanh terms)."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core


# the kernels' primitives: Pallas, and cuDNN's flash attention forward (MLA on Hopper)
KERNEL_PRIMITIVES = ("pallas_call", "dot_product_attention_fwd_wrapper")


def _runs_kernel(params: dict) -> bool:
  """Whether a primitive's inner jaxprs (in `params`) run a kernel."""
  return any(eqn.primitive.name in KERNEL_PRIMITIVES or _runs_kernel(eqn.params)
             for jaxpr in jax_core.jaxprs_in_params(params) for eqn in jaxpr.eqns)


def _kernel_outputs(prim, *_, **params):
  """Saves what the kernels compute (KDA's chunk values, states and outputs, the grouped
  expert matmuls, flash attention); the rest (projections, norms) is recomputed. A custom
  VJP called inside another's forward rule stays one opaque primitive (JAX's Triton `mha`
  computes its residuals so): saved when a kernel runs inside it."""
  if prim.name in KERNEL_PRIMITIVES:
    return True
  return prim.name.startswith("custom_vjp_call") and _runs_kernel(params)


POLICIES = {
    "none": None,
    "elementwise": None,   # no region; the GLU modules' `recompute`
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "kernels": _kernel_outputs,
}

# name -> what `keep` tags with it (shapes per layer)
SAVEABLE = {
    "kda_proj": "KDA's q, k, v projections before the short conv and its output gate's "
                "[B, T, H, K] each",
    "kda_inputs": "KDA's recurrence inputs: q, k, v after the short conv [B, T, H, K], the "
                  "log-decay g [B, T, H, K] fp32 and beta [B, T, H] fp32",
    "mla_proj": "MLA's q [B, T, H, nope + rope], k, v and output gate",
    "moe_latent": "LatentMoE's latent z = x W_down [B, T, latent]",
    "moe_experts": "the dropless dispatch's sort (order, inverse, group sizes [E]), the "
                   "sorted rows [N*k, latent], the routed experts' x W_g and x W_u [N*k, "
                   "hidden] and their outputs [N*k, latent]",
    "glu_proj": "the gated MLPs' x W_g and x W_u (shared experts, dense FFN) [B, T, hidden]",
    "glu_out": "the gated MLPs' activation h, W_d's input (shared experts, dense FFN) "
               "[B, T, hidden]",
    "layer_out": "each layer's mixer and FFN outputs [B, T, d], what the residual stream "
                 "or AttnRes adds",
}


def recomputed(fn):
  """fn(*arrays) whose backward recomputes it from its inputs: of an elementwise function
  the compiled program would otherwise keep fp32 intermediates (4 bytes an element each,
  where a bf16 input holds 2). The barrier on the inputs keeps XLA from merging the
  recomputation into the forward's (which would keep them again); unlike `jax.checkpoint`'s,
  it leaves the incoming cotangent free to fuse into the backward."""
  @jax.custom_vjp
  def f(*args):
    return fn(*args)

  def fwd(*args):
    return fn(*args), args

  def bwd(args, cot):
    return jax.vjp(fn, *jax.lax.optimization_barrier(args))[1](cot)

  f.defvjp(fwd, bwd)
  return f


def recomputes_activations(remat: str) -> bool:
  """Whether `model.remat` has the GLU activations `recomputed` ("elementwise")."""
  return remat == "elementwise"


def keep(name: str, x: jax.Array) -> jax.Array:
  """x, tagged `name` (one of SAVEABLE) for `model.remat_save`."""
  if name not in SAVEABLE:
    raise ValueError(f"remat.keep: unknown name {name!r}; known: {tuple(SAVEABLE)}")
  return checkpoint_name(x, name)


def parse_save(save: str) -> tuple[str, ...]:
  """`model.remat_save` ("kda_proj,glu_proj", "" for none) as a tuple of names."""
  return tuple(s.strip() for s in save.split(",") if s.strip())


def policy(remat: str, save: str = ""):
  """The `jax.checkpoint` policy of `remat` (None: no remat) keeping `save`'s names too."""
  base = POLICIES[remat]
  names = parse_save(save)
  if base is None or not names:
    return base
  return jax.checkpoint_policies.save_from_both_policies(
      base, jax.checkpoint_policies.save_only_these_names(*names))


def wrap(fn, remat: str, save: str = ""):
  """fn under `jax.checkpoint` with `policy(remat, save)`; fn itself for remat "none"."""
  chosen = policy(remat, save)
  return fn if chosen is None else jax.checkpoint(fn, policy=chosen)

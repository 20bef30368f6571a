"""The K3 model: components are named after the K3 spec (kda, mla, attn_res, latent_moe, ...)."""

from k3jax.model.k3 import K3Model, layer_plan

__all__ = ["K3Model", "layer_plan"]

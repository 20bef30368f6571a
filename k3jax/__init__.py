"""k3jax: a JAX/Flax NNX training framework for the K3 architecture."""

__version__ = "0.1.0"

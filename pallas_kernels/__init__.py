"""Accelerator kernels for k3jax: one folder per op, each with a plain-JAX reference."""

"""Test-wide settings: 8 simulated CPU devices for mesh tests (set before jax loads)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

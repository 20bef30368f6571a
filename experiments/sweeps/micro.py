"""A 2-arm, 2-seed sweep of a 2-layer k3_tiny (d 64, 12 steps of 2 x 32 tokens): SiTU-GLU vs
SwiGLU. `tests/test_sweep.py` kills it mid-way, resumes it and reads its report.

  python -m k3jax.sweep --sweep=experiments/sweeps/micro.py --workdir=/tmp/micro_sweep
"""


def get_sweep(arg=None):
  if arg:
    raise ValueError(f"experiments/sweeps/micro.py has no variants, got {arg!r}")
  return {
      "config": "experiments/k3_tiny.py",
      "overrides": {
          "model.num_layers": 2, "model.mla_every": 2, "model.dense_layers": 0,
          "model.d_model": 64, "train.seq_len": 32, "train.global_batch": 2,
          "train.steps": 12, "train.log_every": 1, "train.eval_every": 6,
          "train.eval_batches": 1, "train.checkpoint_every": 3, "optimizer.warmup_steps": 1,
      },
      "arms": [
          ("situ_glu", {}),
          ("swiglu", {"model.ffn.activation": "swiglu"}),
      ],
      "seeds": [0, 1],
  }

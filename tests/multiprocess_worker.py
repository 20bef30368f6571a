"""One process of tests/test_multiprocess.py, started by `launch.local`:

  python -m launch.local --processes=2 --module=multiprocess_worker -- WORKDIR STOP_AFTER

trains `mp_config()` in WORKDIR for STOP_AFTER steps (resuming from its checkpoint). The
test's one-process runs train the same `mp_config()` in the pytest process.
"""

import sys

from conftest import micro_config

from k3jax import train as k3train
from k3jax.parallel import distributed


def mp_config():
  """micro_config cut to one scanned [KDA, MLA] cycle with LatentMoE, parameters sharded
  across the processes (fsdp 4 spans both halves of 2 x 4 devices) and experts across
  expert 2. AdamW and no eval: every multi-process run compiles from scratch in each
  process (launch.local turns the compilation cache off), and Muon's compile would
  double that; Muon's sharded update has its own test (test_parallel.py)."""
  c = micro_config()
  c.model.vocab_size = 384  # byte tokenizer: 258 ids
  c.optimizer.name = "adamw"
  c.model.num_layers, c.model.mla_every, c.model.dense_layers = 2, 2, 0
  c.model.attn_res.block_layers = 1
  c.train.steps, c.train.global_batch = 4, 8
  c.train.checkpoint_every, c.train.eval_every = 2, 0
  c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 4, 2
  return c


def main(argv):
  workdir, stop_after = argv[1], int(argv[2])
  distributed.initialize()  # from launch.local's environment
  k3train.train(mp_config(), workdir, stop_after=stop_after)


if __name__ == "__main__":
  main(sys.argv)

"""The full K3 model: 93 layers, d 7168, 896 experts top-16, 2.78T parameters.

  python -m k3jax.params --config=experiments/k3_full.py
  python -m k3jax.train --config=experiments/k3_full.py --workdir=gs://...
  python -m k3jax.aot --config=experiments/k3_full.py:v5p-2048 --topology=v5:8x8x16 \
      --chip_config=megacore --chips_per_host_bounds=2,2,1

Every value is the default of `k3jax.config.base_config()` (K3_SPEC section 1), with the
MoonViT-V2 vision tower (K3_SPEC 6: 27 layers, width 1024, 401M + the released 46M projector) built.

`FILE:<variant>` sets the mesh, batch, micro-batching, remat and MoE dispatch for one TPU
slice (`VARIANTS`; the name counts TensorCores: a v5p chip is one JAX device of 2 cores, an
Ironwood chip two devices of 1 core each). Their per-chip HBM, FLOPs and fit, compiled for
the slice from a CPU by `k3jax.aot`, are in benchmarks/results/aot_k3_full.md.
"""

from k3jax import config as k3config

# name -> the libtpu topology it was sized for (`k3jax.aot.topology_devices` keywords) and
# the config fields it sets. Every mesh axis is explicit: they multiply to the devices.
# Measured in aot_k3_full.md (what is live at the step's peak, per device).
_V5P_2048 = dict(name="v5:8x8x16", chip_config="megacore", chips_per_host_bounds=(2, 2, 1))
# One sequence per device: the batch rows split over fsdp x expert. Experts over 128 devices
# (896 = 2^7 x 7 caps the axis there): each device holds 7 whole experts per layer and
# all-gathers only their latent shards over fsdp, far less than experts over 8 ways would
# gather; the capacity buffers that the all-to-all moves are the same size whatever the
# split. The other weights are split over fsdp x expert (the `embed` rule). Tensor
# parallelism must divide the vision tower's 12 heads and a physical torus axis (8, 16 on
# v5p), so it stays 1. The capacity dispatch holds 896 x 147 rows per sequence where the
# dropless one ("auto") reserves its worst case, 8 x 65,536. Each scanned layer is its own
# remat region (the backward holds one layer's activations, not a cycle's four), the scan
# over cycles saves each cycle's AttnRes partial slot, not the whole 9-slot buffer, and the
# LM head + loss run 512 positions at a time (no [4096, 163840] fp32 logits). The sizes:
# benchmarks/results/aot_k3_full.md.
_PRETRAIN = {"mesh.data": 1, "mesh.fsdp": 8, "mesh.expert": 128, "mesh.tensor": 1,
             "train.seq_len": 4_096, "train.global_batch": 1_024, "train.microbatches": 1,
             "train.loss_chunk": 512, "model.remat": "full", "model.remat_scope": "layer",
             "model.attn_res.scan_saves": "partial", "model.moe.dispatch": "expert_parallel",
             # splash attention on TPU: no [B, H, T, T] scores (131,072 tokens need it)
             "model.mla.attention": "auto"}
_LONG = {**_PRETRAIN, "train.seq_len": 1_048_576, "train.global_batch": 4,
         "train.microbatches": 1, "mesh.fsdp": 4, "mesh.expert": 128, "mesh.context": 2,
         "mesh.split_physical_axes": True, "mesh.expert_splits": "seq",
         "model.mla.form": "absorbed",
         "train.xla_options": "xla_tpu_enable_latency_hiding_scheduler=false"}
VARIANTS = {
    # 1,024 v5p chips, 1,024 x 4,096 tokens per step. Fits, and is the
    # smallest v5p slice that does: on half of it the state alone leaves too little room
    # (benchmarks/results/aot_k3_full.md).
    "v5p-2048": dict(topology=_V5P_2048, fields=_PRETRAIN),
    # 512 Ironwood chips = 1,024 devices (one per die): the same layout, with
    # XLA's latency-hiding scheduler off: it fits then, while with it on the collectives it
    # overlaps hold more than a device has (benchmarks/results/aot_k3_full.md). What the
    # lost overlap costs in step time can only be measured on Ironwood.
    "tpu7x-1024": dict(topology=dict(name="tpu7x:8x8x8"), fields={
        **_PRETRAIN, "train.xla_options": "xla_tpu_enable_latency_hiding_scheduler=false"}),
    # Long context without context parallelism: one 131,072-token sequence per chip. Does
    # not fit, by far (benchmarks/results/aot_k3_full.md); 4,096 is the longest sequence
    # that does.
    "v5p-2048-128k": dict(topology=_V5P_2048, fields={**_PRETRAIN, "train.seq_len": 131_072}),
    # K3's 1,048,576-token context: four sequences a step (4.19M tokens, as in pretraining),
    # the rows over fsdp (4), each row's positions over expert x context (128 x 2 = 256
    # slices of 4,096): every device holds 4,096 positions, as in pretraining, and no
    # microbatch loop is needed. fsdp 4 x context 2 share the 8-chip x ring
    # (mesh.split_physical_axes). The experts stay on the 128-way expert axis
    # (mesh.expert_splits: it splits positions, not rows). MLA in its absorbed form: each
    # device attends over all earlier positions of its row through the gathered c_kv and
    # shared key (576 values a token) instead of 96 heads' keys and values. XLA's
    # latency-hiding scheduler off, as on tpu7x-1024. Its fit: aot_k3_full.md, Long context.
    "v5p-2048-1m": dict(topology=_V5P_2048, fields=_LONG),
    "tpu7x-1024-1m": dict(topology=dict(name="tpu7x:8x8x8"), fields=_LONG),
}


def get_config(arg: str | None = None):
  c = k3config.base_config()
  c.model.vision.enabled = True
  c.data.worker_count = 8  # per training process: pieces read ahead of packing
  # per platform and mesh: the rule of k3jax.model.moe_dispatch.resolve_dispatch
  c.model.moe.dispatch = "auto"
  if arg:
    if arg not in VARIANTS:
      raise ValueError(f"experiments/k3_full.py:{arg}: unknown variant "
                       f"(known: {', '.join(VARIANTS)})")
    c.update_from_flattened_dict(VARIANTS[arg]["fields"])
  return c

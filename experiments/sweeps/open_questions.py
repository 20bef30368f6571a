"""K3's open design questions, one group of arms each, 3 seeds an arm; every arm changes
one choice of the base config ("baseline": K3's own choices).

  python -m k3jax.sweep --sweep=experiments/sweeps/open_questions.py --workdir=/tmp/oq
  python -m k3jax.sweep --sweep=experiments/sweeps/open_questions.py:small --workdir=DIR \
      --parallel=8                      # k3_small, one H200 a run
  python -m k3jax.report --workdir=/tmp/oq

  kda_mla_ratio  KDA:MLA in the hybrid cycles: all MLA, 1:1, 3:1 (K3), 7:1, all KDA. The
                 cycles span 8 layers before the final MLA, so every ratio fills them:
                 k3_tiny's 9 layers as they are; k3_small's ratio arms have 9 layers too
                 (12 + 1 does not take 7:1), with their own 3:1 reference.
  attn_res       Block Attention Residuals in blocks of 1, 3, 9 layers and the base's 4,
                 against the plain residual stream.
  latent_moe     the routed experts in a latent of half the width (K3) or the full width.
  glu            SiTU-GLU (K3) or SwiGLU, in every FFN and expert.
  balancing      Quantile Balancing (K3), DeepSeek-V3's auxiliary-loss-free bias (its
                 default speed), Switch's auxiliary loss at its weight 0.01.
  optimizer      Muon per head (K3), Muon on whole matrices, AdamW (the same schedule).
  kda_gate       the bounded decay gate (K3) or Kimi Linear's softplus gate (unbounded: KDA's
                 diagonal tiles without the bounded gate's factoring).

"small": k3_small, each run 2,000 of its steps (a fifth of its own run).
"""

VARIANTS = {
    None: {"config": "experiments/k3_tiny.py", "d_model": 128, "num_layers": 9,
           "overrides": {}},
    "small": {"config": "experiments/k3_small.py", "d_model": 2_048, "num_layers": 13,
              "overrides": {"train.steps": 2_000, "optimizer.warmup_steps": 200,
                            "train.eval_every": 250, "train.checkpoint_every": 250}},
}
RATIO_LAYERS = 9   # 8 layers of cycles + the final MLA: 1, 2, 4 and 8 divide 8


def ratio_arms(num_layers: int) -> tuple[list, str]:
  """The KDA:MLA arms at RATIO_LAYERS layers, and the group's 3:1 arm: the baseline, or one
  of its own where the base has another depth."""
  depth = {} if num_layers == RATIO_LAYERS else {"model.num_layers": RATIO_LAYERS}
  every = {"all_mla": 1, "kda1_mla1": 2, "kda3_mla1": 4, "kda7_mla1": 8}
  arms = [(name, {**depth, "model.mla_every": n}) for name, n in every.items()
          if depth or name != "kda3_mla1"]
  arms.append(("all_kda", {**depth, "model.mla_every": RATIO_LAYERS + 1,
                           "model.final_mla": False}))
  return arms, "kda3_mla1" if depth else "baseline"


def get_sweep(arg=None):
  if arg not in VARIANTS:
    raise ValueError(f"experiments/sweeps/open_questions.py: unknown variant {arg!r} "
                     "(known: small)")
  v = VARIANTS[arg]
  ratio, three_to_one = ratio_arms(v["num_layers"])
  arms = [("baseline", {}), *ratio,
          ("plain_residual", {"model.attn_res.enabled": False}),
          ("attn_res_block1", {"model.attn_res.block_layers": 1}),
          ("attn_res_block3", {"model.attn_res.block_layers": 3}),
          ("attn_res_block9", {"model.attn_res.block_layers": 9}),
          ("latent_full", {"model.moe.latent_dim": v["d_model"]}),
          ("swiglu", {"model.ffn.activation": "swiglu"}),
          ("aux_free", {"model.moe.balancing": "aux_free"}),
          ("aux_loss", {"model.moe.balancing": "aux_loss", "model.moe.aux_loss_weight": 0.01}),
          ("muon_whole_matrix", {"optimizer.muon.per_head": False}),
          ("adamw", {"optimizer.name": "adamw"}),
          ("softplus_gate", {"model.kda.gate": "softplus"})]
  return {
      "config": v["config"],
      "overrides": v["overrides"],
      "arms": arms,
      "seeds": [0, 1, 2],
      "groups": {
          "kda_mla_ratio": ["all_mla", "kda1_mla1", three_to_one, "kda7_mla1", "all_kda"],
          "attn_res": ["plain_residual", "attn_res_block1", "attn_res_block3", "baseline",
                       "attn_res_block9"],
          "latent_moe": ["baseline", "latent_full"],
          "glu": ["baseline", "swiglu"],
          "balancing": ["baseline", "aux_free", "aux_loss"],
          "optimizer": ["baseline", "muon_whole_matrix", "adamw"],
          "kda_gate": ["baseline", "softplus_gate"],
      },
  }

"""Where the MoonViT-V2 tower and projector live in the released Kimi K3 checkpoint.

Release: `vision_tower.*`, `mm_projector.*`, bf16 torch [out, in]; patch Conv2d
[width, 3, P, P]; fused `wqkv` [3 * H * D, width]. Other forms are refused, naming the field."""

from __future__ import annotations

import numpy as np

from k3jax.convert.layout import (BF16, Rule, dense_weight, linear, one_tensor, torch_weight,
                                  vector_weight, whole)

TOWER, PROJECTOR = "vision_tower.", "mm_projector."
BLOCKS = TOWER + "encoder.blocks."


def check_release_form(v) -> None:
  """ValueError naming the first `model.vision` field whose form the release lacks."""
  wanted = {"rope_2d": True, "projector_hidden": -1,
            "projector_norm": "post", "projector_act": "gelu"}
  for field, value in wanted.items():
    if v[field] != value:
      raise ValueError(f"model.vision.{field}={v[field]!r}: the released K3's tower has "
                       f"{value!r}; only that form maps to its tensors")


def global_rules(m) -> list[Rule]:
  """The tower's patch embedding, position table and final norm, and the projector."""
  v = m.vision
  check_release_form(v)
  p, w, merged = v.patch_size, v.width, v.merge * v.merge * v.width

  return [   # the patch kernel [P * P * 3, width] from the conv [width, 3, P, P]
      one_tensor("vision/patch_embed/kernel", TOWER + "patch_embed.proj.weight", BF16, (w, 3, p, p),
                 whole(lambda conv: conv.transpose(2, 3, 1, 0).reshape(p * p * 3, w)),
                 lambda k: k.reshape(p, p, 3, w).transpose(3, 2, 0, 1).astype(BF16)),
      one_tensor("vision/pos_table", TOWER + "patch_embed.pos_emb.weight", BF16,
                 (v.pos_grid, v.pos_grid, w), lambda src: src, lambda t: t.astype(BF16)),
      vector_weight("vision/final_norm/weight", TOWER + "encoder.final_layernorm.weight", w),
      dense_weight("vision/projector/w1/kernel", PROJECTOR + "proj.0.weight", (merged,), (merged,)),
      dense_weight("vision/projector/w2/kernel", PROJECTOR + "proj.2.weight", (merged,),
                   (m.d_model,)),
      vector_weight("vision/projector/norm/weight", PROJECTOR + "post_norm.weight", m.d_model),
  ]


def block_rules(m, i: int) -> list[Rule]:
  """Block i of the tower (k3jax: entry i of the stacked `vision/blocks/...`)."""
  v = m.vision
  w, h, d = v.width, v.num_heads, v.head_dim
  s, p = f"{BLOCKS}{i}.", "vision/blocks/"
  qkv_paths = tuple(f"{p}{x}/kernel" for x in ("wq", "wk", "wv"))

  def qkv_load(src):
    return [linear((w,), (h, d), row_offset=j * h * d)(src[0]) for j in range(3)]

  def qkv_save(ws):
    return [np.concatenate([torch_weight(x, 1) for x in ws], axis=0).astype(BF16)]

  return [
      vector_weight(p + "attn_norm/weight", s + "norm0.weight", w),
      vector_weight(p + "mlp_norm/weight", s + "norm1.weight", w),
      Rule(qkv_paths, (s + "wqkv.weight",), (BF16,), ((3 * h * d, w),), qkv_load, qkv_save),
      dense_weight(p + "wo/kernel", s + "wo.weight", (h, d), (w,)),
      dense_weight(p + "w1/kernel", s + "mlp.fc0.weight", (w,), (v.mlp_dim,)),
      dense_weight(p + "w2/kernel", s + "mlp.fc1.weight", (v.mlp_dim,), (w,)),
  ]

"""The released Kimi K3 text model's forward in float64 NumPy, written from the equations of
the engines that load the release (its reference modeling code, sglang, vLLM, llama.cpp),
over the release's tensors by name: the oracle that imported weights are checked against.
Nothing here comes from k3jax's modules. One sequence, one document, no padding.

`logits(t, cfg, tokens)`: t maps release names to arrays (MXFP4 experts already
dequantized, under the packed name); cfg is the release's text_config; tokens [T] int.
"""

from __future__ import annotations

import numpy as np

LAYER = "language_model.model.layers.{}."


def rms_norm(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def sigmoid(x):
  return 0.5 * (1 + np.tanh(0.5 * x))       # = 1 / (1 + e^-x), without overflow


def silu(x):
  return x * sigmoid(x)


def situ(g, u, b1, b2):
  return b1 * np.tanh(g / b1) * sigmoid(g) * (b2 * np.tanh(u / b2))


def linear(x, w):                       # torch weight [out, in]
  return x @ np.asarray(w, np.float64).T


def attn_res(prefix, banked, proj, norm, eps):
  """softmax over [banked..., prefix] of (RMSNorm(v) * norm * proj), summed raw."""
  values = np.stack([*banked, prefix])                          # [S, T, d]
  keys = values / np.sqrt(np.mean(values ** 2, axis=-1, keepdims=True) + eps)
  scores = keys @ (np.asarray(norm, np.float64) * np.asarray(proj, np.float64).reshape(-1))
  p = np.exp(scores - scores.max(0))
  p /= p.sum(0)
  return np.einsum("st,std->td", p, values)


def short_conv(x, w):
  """Causal depthwise conv: w [C, 1, W], the last tap on the current token; then SiLU."""
  width = w.shape[-1]
  xp = np.concatenate([np.zeros((width - 1, x.shape[1])), x])
  out = sum(xp[i:i + len(x)] * w[:, 0, i] for i in range(width))
  return silu(out)


def kda(x, t, p, c):
  lin = c["linear_attn_config"]
  h, k = lin["num_heads"], lin["head_dim"]
  s = p + "self_attn."
  n = len(x)

  def heads(a):
    return a.reshape(n, h, k)

  def l2(a):
    return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)

  q = l2(heads(short_conv(linear(x, t[s + "q_proj.weight"]), t[s + "q_conv1d.weight"])))
  kk = l2(heads(short_conv(linear(x, t[s + "k_proj.weight"]), t[s + "k_conv1d.weight"])))
  v = heads(short_conv(linear(x, t[s + "v_proj.weight"]), t[s + "v_conv1d.weight"]))
  f = heads(linear(linear(x, t[s + "f_a_proj.weight"]), t[s + "f_b_proj.weight"])
            + t[s + "dt_bias"])
  a = np.exp(np.asarray(t[s + "A_log"], np.float64)[:h])[None, :, None]
  g = lin["gate_lower_bound"] * sigmoid(a * f)                  # [T, H, K], log decay
  beta = sigmoid(linear(x, t[s + "b_proj.weight"]))              # [T, H]
  o = np.zeros((n, h, k))
  for head in range(h):
    state = np.zeros((k, k))
    for i in range(n):
      state = np.exp(g[i, head])[:, None] * state
      err = v[i, head] - state.T @ kk[i, head]
      state = state + beta[i, head] * np.outer(kk[i, head], err)
      o[i, head] = state.T @ (q[i, head] * k ** -0.5)
  o = rms_norm(o, t[s + "o_norm.weight"], c["rms_norm_eps"])
  o = o * sigmoid(heads(linear(x, t[s + "g_proj.weight"])))
  return linear(o.reshape(n, h * k), t[s + "o_proj.weight"])


def mla(x, t, p, c, lora_eps):
  s = p + "self_attn."
  n, h = len(x), c["num_attention_heads"]
  nope, rope, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
  q = linear(rms_norm(linear(x, t[s + "q_a_proj.weight"]), t[s + "q_a_layernorm.weight"],
                      lora_eps), t[s + "q_b_proj.weight"]).reshape(n, h, nope + rope)
  ckv = linear(x, t[s + "kv_a_proj_with_mqa.weight"])
  c_kv, k_pe = ckv[:, :c["kv_lora_rank"]], ckv[:, c["kv_lora_rank"]:]
  kv = linear(rms_norm(c_kv, t[s + "kv_a_layernorm.weight"], lora_eps),
              t[s + "kv_b_proj.weight"]).reshape(n, h, nope + dv)
  k = np.concatenate([kv[..., :nope], np.broadcast_to(k_pe[:, None], (n, h, rope))], -1)
  v = kv[..., nope:]
  scores = np.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
  scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
  w = np.exp(scores - scores.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  out = np.einsum("hts,shd->thd", w, v) * sigmoid(linear(x, t[s + "g_proj.weight"])).reshape(
      n, h, dv)
  return linear(out.reshape(n, h * dv), t[s + "o_proj.weight"])


def mlp(x, t, s, c):
  b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
  return linear(situ(linear(x, t[s + "gate_proj.weight"]), linear(x, t[s + "up_proj.weight"]),
                     b1, b2), t[s + "down_proj.weight"])


def moe(x, t, p, c):
  s = p + "block_sparse_moe."
  b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
  scores = sigmoid(linear(x, t[s + "gate.weight"]))                   # [T, E]
  choice = scores + t[s + "gate.e_score_correction_bias"]
  top = np.argsort(-choice, axis=-1, kind="stable")[:, :c["num_experts_per_token"]]
  z = linear(x, t[s + "routed_expert_down_proj.weight"])
  u = np.zeros_like(z)
  for i in range(len(x)):
    w = scores[i, top[i]]
    w = w / w.sum() * c["routed_scaling_factor"]
    for j, e in zip(w, top[i]):
      e_ = f"{s}experts.{e}."
      hid = situ(linear(z[i], t[e_ + "w1.weight_packed"]), linear(z[i], t[e_ + "w3.weight_packed"]),
                 b1, b2)
      u[i] += j * linear(hid, t[e_ + "w2.weight_packed"])
  u = rms_norm(u, t[s + "routed_expert_norm.weight"], c["rms_norm_eps"])
  return linear(u, t[s + "routed_expert_up_proj.weight"]) + mlp(x, t, s + "shared_experts.", c)


def logits(t: dict, c: dict, tokens: np.ndarray, *, lora_eps: float = 1e-6,
           image: tuple | None = None) -> np.ndarray:
  """[T, vocab] float64. lora_eps: the MLA q/kv LoRA norms' epsilon (the release's modeling
  code builds them with its RMSNorm default, 1e-6; the engines use rms_norm_eps).
  image: (placeholder id, features [K, d]) written over the placeholder tokens in order."""
  eps, block = c["rms_norm_eps"], c["attn_res_block_size"]
  mla_layers = set(c["linear_attn_config"]["full_attn_layers"])
  prefix = np.asarray(t["language_model.model.embed_tokens.weight"], np.float64)[tokens]
  if image is not None:
    placeholder, features = image
    prefix[tokens == placeholder] = features[:int(np.sum(tokens == placeholder))]
  banked = []
  for layer in range(c["num_hidden_layers"]):
    p = LAYER.format(layer)
    h = attn_res(prefix, banked, t[p + "self_attention_res_proj.weight"],
                 t[p + "self_attention_res_norm.weight"], eps) if banked else prefix
    if layer % block == 0:
      banked.append(prefix)
      prefix = None
    x = rms_norm(h, t[p + "input_layernorm.weight"], eps)
    a = mla(x, t, p, c, lora_eps) if layer + 1 in mla_layers else kda(x, t, p, c)
    prefix = a if prefix is None else prefix + a
    h = attn_res(prefix, banked, t[p + "mlp_res_proj.weight"], t[p + "mlp_res_norm.weight"], eps)
    x = rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
    dense = layer < c["first_k_dense_replace"]
    prefix = prefix + (mlp(x, t, p + "mlp.", c) if dense else moe(x, t, p, c))
  h = attn_res(prefix, banked, t["language_model.model.output_attn_res_proj.weight"],
               t["language_model.model.output_attn_res_norm.weight"], eps)
  h = rms_norm(h, t["language_model.model.norm.weight"], eps)
  return linear(h, t["language_model.lm_head.weight"])


# The vision tower (MoonViT3d as released) and its projector, for one image.

def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
  from math import erf  # noqa: PLC0415
  return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def resize_bilinear(table, h, w):
  """torch's F.interpolate(mode="bilinear", align_corners=False) of [G, G, D] to [h, w, D]."""
  def taps(n_out, n_in):
    src = np.maximum((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0.0)
    i0 = np.floor(src).astype(int)
    i1 = np.where(i0 < n_in - 1, i0 + 1, i0)
    return i0, i1, src - i0
  y0, y1, fy = taps(h, table.shape[0])
  x0, x1, fx = taps(w, table.shape[1])
  fy, fx = fy[:, None, None], fx[None, :, None]
  t = np.asarray(table, np.float64)
  return ((1 - fy) * ((1 - fx) * t[y0][:, x0] + fx * t[y0][:, x1])
          + fy * ((1 - fx) * t[y1][:, x0] + fx * t[y1][:, x1]))


def rope2d(x, h, w, theta=10_000.0):
  """x [h*w, heads, D], positions row-major: channel pairs as complex numbers turned by
  [col f_0, row f_0, col f_1, ...], f_j = theta^(-4j/D)."""
  n, _, d = x.shape
  pos = np.arange(n)
  col, row = pos % w, pos // w
  f = theta ** (-4.0 * np.arange(d // 4) / d)
  angle = np.stack([col[:, None] * f, row[:, None] * f], -1).reshape(n, 1, d // 2)
  z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = z.real, z.imag
  return out


def sincos_rows(n, dim, base=10_000.0):
  """The release's fixed time embedding [n, dim]: [sin | cos] of base^(-2i / dim) * frame."""
  angle = np.arange(n)[:, None] * base ** (-np.arange(dim // 2) / (dim // 2))[None, :]
  return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)


def media_features(t: dict, frames: np.ndarray, *, patch: int, heads: int, block_eps: float,
                   projector_eps: float) -> np.ndarray:
  """frames [F, H, W, 3] (one image: F = 1; H, W multiples of 2 * patch) -> features
  [H W / (2 patch)^2, d]: the frames' merged windows averaged over the F frames."""
  f, h, w = frames.shape[0], frames.shape[1] // patch, frames.shape[2] // patch
  pix = frames.reshape(f, h, patch, w, patch, 3).transpose(0, 1, 3, 5, 2, 4).reshape(f * h * w,
                                                                                     -1)
  conv = np.asarray(t["vision_tower.patch_embed.proj.weight"], np.float64)   # [D, 3, P, P]
  x = pix @ conv.reshape(conv.shape[0], -1).T
  pos = resize_bilinear(t["vision_tower.patch_embed.pos_emb.weight"], h, w).reshape(h * w, -1)
  pos = np.tile(pos[None], (f, 1, 1))
  if f > 1:
    pos = pos + sincos_rows(f, pos.shape[-1])[:, None, :]
  x = x + pos.reshape(f * h * w, -1)
  n, i = f * h * w, 0
  while f"vision_tower.encoder.blocks.{i}.wqkv.weight" in t:
    b = f"vision_tower.encoder.blocks.{i}."
    qkv = linear(rms_norm(x, t[b + "norm0.weight"], block_eps), t[b + "wqkv.weight"])
    q, k, v = (a.reshape(f, h * w, heads, -1) for a in np.split(qkv, 3, axis=-1))
    q, k = (np.stack([rope2d(a[j], h, w) for j in range(f)]).reshape(n, heads, -1)
            for a in (q, k))
    v = v.reshape(n, heads, -1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = x + linear(np.einsum("hqk,khd->qhd", p, v).reshape(n, -1), t[b + "wo.weight"])
    u = linear(rms_norm(x, t[b + "norm1.weight"], block_eps), t[b + "mlp.fc0.weight"])
    x = x + linear(gelu_tanh(u), t[b + "mlp.fc1.weight"])
    i += 1
  x = rms_norm(x, t["vision_tower.encoder.final_layernorm.weight"], block_eps)
  windows = x.reshape(f, h // 2, 2, w // 2, 2, -1).transpose(0, 1, 3, 2, 4, 5).mean(0)
  y = linear(gelu_erf(linear(windows.reshape(h * w // 4, -1), t["mm_projector.proj.0.weight"])),
             t["mm_projector.proj.2.weight"])
  return rms_norm(y, t["mm_projector.post_norm.weight"], projector_eps)

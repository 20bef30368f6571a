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


def logits(t: dict, c: dict, tokens: np.ndarray, *, lora_eps: float = 1e-6) -> np.ndarray:
  """[T, vocab] float64. lora_eps: the MLA q/kv LoRA norms' epsilon (the release's modeling
  code builds them with its RMSNorm default, 1e-6; the engines use rms_norm_eps)."""
  eps, block = c["rms_norm_eps"], c["attn_res_block_size"]
  mla_layers = set(c["linear_attn_config"]["full_attn_layers"])
  prefix = np.asarray(t["language_model.model.embed_tokens.weight"], np.float64)[tokens]
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

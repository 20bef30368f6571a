"""Where each k3jax parameter lives in the released Kimi K3 checkpoint (vision: `vision_layout`).

`rules(model_cfg)` lists `Rule`s mapping "/"-joined parameter paths to release tensors both
ways. The release: torch [out, in], heads head-major, MXFP4 routed experts, fused shared
experts, reversed conv taps; fp32 A_log, dt_bias, convs, o_norm, router bias; the rest bf16."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import ml_dtypes
import numpy as np

from k3jax.convert import stream
from k3jax.convert.stream import Box, Source
from k3jax.model import mxfp4
from k3jax.model.k3 import layer_plan

BF16, F32, U8 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.uint8)
TEXT = "language_model."
LAYERS = TEXT + "model.layers."


@dataclasses.dataclass(frozen=True)
class Rule:
  """k3jax parameters `paths` <-> release tensors `names`: `load` Sources, `save` arrays."""
  paths: tuple[str, ...]
  names: tuple[str, ...]
  dtypes: tuple[np.dtype, ...]
  shapes: tuple[tuple[int, ...], ...]
  load: Callable[[Sequence[Source]], Sequence[Source]]
  save: Callable[[Sequence[np.ndarray]], Sequence[np.ndarray]]
  mxfp4: bool = False        # names are (packed, scales) pairs of MXFP4 weights


def _contiguous(idx: np.ndarray) -> bool:
  return idx[-1] - idx[0] + 1 == len(idx) and bool(np.all(np.diff(idx) == 1))


def _span_gather(src: Source, rows: np.ndarray, cols: np.ndarray) -> stream.Part:
  """src[rows][:, cols] for index arrays, reading the rows' covering span once."""
  r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
  block = stream.as_part(src(((int(r0), int(r1)), (int(c0), int(c1)))))
  if _contiguous(rows) and _contiguous(cols):
    return block
  index = np.ix_(rows - r0, cols - c0)
  return block.map(lambda x: x[index], ("gather", rows.tobytes(), cols.tobytes()))


def _flat(box: Box, shape: tuple[int, ...]) -> np.ndarray:
  grids = np.meshgrid(*[np.arange(a, b) for a, b in box], indexing="ij")
  return np.ravel_multi_index(tuple(g.ravel() for g in grids), shape) if box else np.zeros(1, int)


def linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...], *, row_offset: int = 0,
           col_offset: int = 0) -> Callable[[Source], Source]:
  """A k3jax kernel [*in, *out] from a torch weight [out, in], at an optional offset."""
  n_in = len(in_shape)

  def load(src: Source) -> Source:
    def read(box: Box) -> stream.Part:
      in_box, out_box = box[:n_in], box[n_in:]
      rows = _flat(out_box, out_shape) + row_offset
      cols = _flat(in_box, in_shape) + col_offset
      sub = _span_gather(src, rows, cols)                    # [n_out, n_in]
      shape = [b - a for a, b in in_box] + [b - a for a, b in out_box]
      return sub.map(lambda x: x.T.reshape(shape), ("linear", tuple(shape)))
    return read
  return load


def torch_weight(w: np.ndarray, n_in: int) -> np.ndarray:
  """A k3jax kernel [*in, *out] as the torch weight [out, in]."""
  return w.reshape(math.prod(w.shape[:n_in]), -1).T


def whole(fn: Callable[[jax.Array], jax.Array]) -> Callable[[Source], Source]:
  """A small parameter: the whole release tensor read, `fn` applied, the box cut out."""
  def load(src: Source) -> Source:
    def read(box: Box) -> stream.Part:
      cut = tuple(slice(a, b) for a, b in box)
      return stream.as_part(src(None)).map(lambda x: fn(x)[cut], None)
    return read
  return load


def one_tensor(path, name, dtype, shape, load, save) -> Rule:
  return Rule((path,), (name,), (dtype,), (tuple(shape),), lambda s: [load(s[0])],
              lambda a: [save(a[0])])


def dense_weight(path, name, in_shape, out_shape, dtype=BF16) -> Rule:
  return one_tensor(path, name, dtype, (math.prod(out_shape), math.prod(in_shape)),
                    linear(in_shape, out_shape),
                    lambda w: torch_weight(w, len(in_shape)).astype(dtype))


def vector_weight(path, name, n, dtype=BF16, shape=None) -> Rule:
  """A vector parameter of n entries; `shape`: the release's."""
  shape = shape or (n,)
  return one_tensor(path, name, dtype, shape, whole(lambda x: x.reshape(-1)),
                    lambda w: w.reshape(shape).astype(dtype))


def _conv(path, name, width, heads, dim) -> Rule:
  """k3jax taps [W, H, D] (tap 0 current) <-> the release's [H * D, 1, W] (last current)."""
  return one_tensor(path, name, F32, (heads * dim, 1, width),
                    whole(lambda x: x.reshape(heads, dim, width)[..., ::-1].transpose(2, 0, 1)),
                    lambda w: w[::-1].transpose(1, 2, 0).reshape(heads * dim, 1, width).astype(F32))


def _a_log(path, name, heads, stored) -> Rule:
  def load_fn(x):
    if np.any(x[heads:] != 0):
      raise ValueError(f"{name}: entries past the {heads} heads must be zero padding")
    return x[:heads]
  return one_tensor(path, name, F32, (stored,), whole(load_fn),
                    lambda w: np.pad(w.astype(F32), (0, stored - heads)))


def _attn_res(path, name, d) -> list[Rule]:
  return [vector_weight(f"{path}/query", f"{name}_proj.weight", d, shape=(1, d)),
          vector_weight(f"{path}/key_gain", f"{name}_norm.weight", d)]


def _kda(m, pre: str, path: str) -> list[Rule]:
  c = m.kda
  d, h, k, w, r = m.d_model, c.num_heads, c.head_dim, c.conv_size, c.gate_rank
  s, p = pre + "self_attn.", path + "mixer/"
  return [
      dense_weight(p + "q_proj/kernel", s + "q_proj.weight", (d,), (h, k)),
      dense_weight(p + "k_proj/kernel", s + "k_proj.weight", (d,), (h, k)),
      dense_weight(p + "v_proj/kernel", s + "v_proj.weight", (d,), (h, k)),
      _conv(p + "q_conv", s + "q_conv1d.weight", w, h, k),
      _conv(p + "k_conv", s + "k_conv1d.weight", w, h, k),
      _conv(p + "v_conv", s + "v_conv1d.weight", w, h, k),
      dense_weight(p + "beta_proj/kernel", s + "b_proj.weight", (d,), (h,)),
      dense_weight(p + "f_down/kernel", s + "f_a_proj.weight", (d,), (r,)),
      dense_weight(p + "f_up/kernel", s + "f_b_proj.weight", (r,), (h, k)),
      _a_log(p + "A_log", s + "A_log", h, max(h, k)),
      one_tensor(p + "dt_bias", s + "dt_bias", F32, (h * k,), whole(lambda x: x.reshape(h, k)),
                 lambda a: a.reshape(-1).astype(F32)),
      dense_weight(p + "gate_proj/kernel", s + "g_proj.weight", (d,), (h, k)),
      vector_weight(p + "o_norm/weight", s + "o_norm.weight", k, F32),
      dense_weight(p + "o_proj/kernel", s + "o_proj.weight", (h, k), (d,)),
  ]


def _mla(m, pre: str, path: str) -> list[Rule]:
  a = m.mla
  d, h = m.d_model, a.num_heads
  qk, kv = a.qk_nope_dim + a.qk_rope_dim, a.qk_nope_dim + a.v_head_dim
  s, p = pre + "self_attn.", path + "mixer/"
  return [
      dense_weight(p + "wq_a/kernel", s + "q_a_proj.weight", (d,), (a.q_lora_rank,)),
      vector_weight(p + "q_norm/weight", s + "q_a_layernorm.weight", a.q_lora_rank),
      dense_weight(p + "wq_b/kernel", s + "q_b_proj.weight", (a.q_lora_rank,), (h, qk)),
      dense_weight(p + "wkv_a/kernel", s + "kv_a_proj_with_mqa.weight", (d,),
                   (a.kv_lora_rank + a.qk_rope_dim,)),
      vector_weight(p + "kv_norm/weight", s + "kv_a_layernorm.weight", a.kv_lora_rank),
      dense_weight(p + "wkv_b/kernel", s + "kv_b_proj.weight", (a.kv_lora_rank,), (h, kv)),
      dense_weight(p + "w_g/kernel", s + "g_proj.weight", (d,), (h, a.v_head_dim)),
      dense_weight(p + "w_o/kernel", s + "o_proj.weight", (h, a.v_head_dim), (d,)),
  ]


def _dense_ffn(m, pre: str, path: str) -> list[Rule]:
  d, f = m.d_model, m.ffn.hidden_dim
  s, p = pre + "mlp.", path + "ffn/"
  return [dense_weight(p + "w_g/kernel", s + "gate_proj.weight", (d,), (f,)),
          dense_weight(p + "w_u/kernel", s + "up_proj.weight", (d,), (f,)),
          dense_weight(p + "w_d/kernel", s + "down_proj.weight", (f,), (d,))]


def _shared(m, s: str, p: str) -> list[Rule]:
  d, n, width = m.d_model, m.moe.num_shared, m.moe.shared_dim
  rules = []
  for part, name, n_in in (("w_g", "gate_proj", 1), ("w_u", "up_proj", 1),
                           ("w_d", "down_proj", 1)):
    paths = tuple(f"{p}shared/{i}/{part}/kernel" for i in range(n))
    down = part == "w_d"

    def load(src, down=down):
      shape = ((width,), (d,)) if down else ((d,), (width,))
      return [linear(*shape, **({"col_offset": i * width} if down else
                                {"row_offset": i * width}))(src[0]) for i in range(n)]

    def save(ws, n_in=n_in, down=down):
      parts = [torch_weight(w, n_in) for w in ws]
      return [np.concatenate(parts, axis=1 if down else 0).astype(BF16)]
    shape = (d, n * width) if down else (n * width, d)
    rules.append(Rule(paths, (f"{s}shared_experts.{name}.weight",), (BF16,), (shape,), load,
                      save))
  return rules


def _experts(m, s: str, p: str) -> list[Rule]:
  """Routed experts [E, in, out] <-> per expert MXFP4 torch weights [out, in]."""
  e, lat, hid = m.moe.num_experts, m.moe.latent_dim, m.moe.expert_dim
  rules = []
  for path, w, in_dim, out_dim in (("w_g", "w1", lat, hid), ("w_u", "w3", lat, hid),
                                   ("w_d", "w2", hid, lat)):
    names = tuple(f"{s}experts.{j}.{w}.{part}" for j in range(e)
                  for part in ("weight_packed", "weight_scale"))

    def load(src, in_dim=in_dim, out_dim=out_dim):
      per = [linear((in_dim,), (out_dim,))(src[2 * j]) for j in range(e)]
      return [stream.stacked(per)]

    def save(ws):
      out = []
      for j in range(ws[0].shape[0]):
        out.extend(mxfp4.quantize(ws[0][j].T))
      return out
    shapes = ((out_dim, in_dim // 2), (out_dim, in_dim // mxfp4.GROUP)) * e
    rules.append(Rule((p + path,), names, (U8,) * (2 * e), shapes, load, save, mxfp4=True))
  return rules


def _moe(m, pre: str, path: str) -> list[Rule]:
  d, e, lat = m.d_model, m.moe.num_experts, m.moe.latent_dim
  s, p = pre + "block_sparse_moe.", path + "ffn/"
  return [
      dense_weight(p + "router/kernel", s + "gate.weight", (d,), (e,)),
      vector_weight(p + "bias", s + "gate.e_score_correction_bias", e, F32),
      dense_weight(p + "w_down/kernel", s + "routed_expert_down_proj.weight", (d,), (lat,)),
      vector_weight(p + "latent_norm/weight", s + "routed_expert_norm.weight", lat),
      dense_weight(p + "w_up/kernel", s + "routed_expert_up_proj.weight", (lat,), (d,)),
      *_shared(m, s, p), *_experts(m, s, p),
  ]


def layer_rules(m, layer: int, mixer: str, ffn: str, path: str) -> list[Rule]:
  """The rules of release layer `layer` (0-based) at k3jax path prefix `path`."""
  pre, d = f"{LAYERS}{layer}.", m.d_model
  return [vector_weight(path + "mixer_norm/weight", pre + "input_layernorm.weight", d),
          vector_weight(path + "ffn_norm/weight", pre + "post_attention_layernorm.weight", d),
          *_attn_res(path + "mixer_query", pre + "self_attention_res", d),
          *_attn_res(path + "ffn_query", pre + "mlp_res", d),
          *(_kda if mixer == "kda" else _mla)(m, pre, path),
          *(_dense_ffn if ffn == "dense" else _moe)(m, pre, path)]


def global_rules(m) -> list[Rule]:
  d, v = m.d_model, m.vocab_size
  return [one_tensor("embed", TEXT + "model.embed_tokens.weight", BF16, (v, d), lambda src: src,
                     lambda w: w.astype(BF16)),
          dense_weight("lm_head/kernel", TEXT + "lm_head.weight", (d,), (v,)),
          vector_weight("final_norm/weight", TEXT + "model.norm.weight", d),
          *_attn_res("out_query", TEXT + "model.output_attn_res", d)]


@dataclasses.dataclass(frozen=True)
class Binding:
  """One k3jax parameter: its (rule, index) per release layer it stacks."""
  parts: tuple[tuple[Rule, int], ...]
  stacked: bool


def bindings(m) -> dict[str, Binding]:
  """k3jax parameter path -> Binding, for every text-model parameter of `m`."""
  plan = layer_plan(m)
  out: dict[str, list] = {}

  def add(rules, stacked):
    for rule in rules:
      for i, path in enumerate(rule.paths):
        out.setdefault(path, ([], stacked))[0].append((rule, i))

  add(global_rules(m), False)
  if m.vision.enabled:
    vision = _vision()
    add(vision.global_rules(m), False)
    for i in range(m.vision.num_layers):
      add(vision.block_rules(m, i), True)
  for i in range(plan.prefix):
    add(layer_rules(m, i, plan.mixers[i], plan.ffns[i], f"prefix/{i}/"), False)
  for c in range(plan.num_cycles):
    for j in range(plan.cycle):
      i = plan.prefix + c * plan.cycle + j
      add(layer_rules(m, i, plan.mixers[i], plan.ffns[i], f"cycles/layers/{j}/"), True)
  start = plan.prefix + plan.num_cycles * plan.cycle
  for i in range(start, len(plan.mixers)):
    add(layer_rules(m, i, plan.mixers[i], plan.ffns[i], f"suffix/{i - start}/"), False)
  return {path: Binding(tuple(parts), stacked) for path, (parts, stacked) in out.items()}


def sources(m, release: Callable[[str], Source]) -> dict[str, Source]:
  """k3jax parameter path -> Source, given a Source per release tensor `release(name)`."""
  out = {}
  for path, binding in bindings(m).items():
    per_layer = [rule.load([release(n) for n in rule.names])[i] for rule, i in binding.parts]
    out[path] = stream.stacked(per_layer) if binding.stacked else per_layer[0]
  return out


def expected(m) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
  """Every release tensor the text model of `m` reads: name -> (dtype, shape)."""
  out = {}
  for binding in bindings(m).values():
    for rule, _ in binding.parts:
      out.update({n: (dt, sh) for n, dt, sh in zip(rule.names, rule.dtypes, rule.shapes)})
  return out


def groups(m):
  """(label, [(rule, stacked index or None), ...]) groups in the release's shard order."""
  plan = layer_plan(m)
  for i in range(len(plan.mixers)):
    if i < plan.prefix:
      path, c = f"prefix/{i}/", None
    elif i < plan.prefix + plan.num_cycles * plan.cycle:
      c, j = divmod(i - plan.prefix, plan.cycle)
      path = f"cycles/layers/{j}/"
    else:
      path, c = f"suffix/{i - plan.prefix - plan.num_cycles * plan.cycle}/", None
    yield f"layer {i}", [(r, c) for r in layer_rules(m, i, plan.mixers[i], plan.ffns[i], path)]
  yield "globals", [(r, None) for r in global_rules(m)]
  if m.vision.enabled:
    vision = _vision()
    yield "vision", ([(r, None) for r in vision.global_rules(m)]
                     + [(r, i) for i in range(m.vision.num_layers)
                        for r in vision.block_rules(m, i)])


def tensors(m, param: Callable[[str, int | None], np.ndarray]):
  """(name, array) release tensors in shard order from `param(path, stacked index)`."""
  for _, pairs in groups(m):
    for rule, c in pairs:
      yield from zip(rule.names, rule.save([param(p, c) for p in rule.paths]))


def _vision():
  """k3jax.convert.vision_layout (imported late: it builds its rules from this module)."""
  from k3jax.convert import vision_layout  # noqa: PLC0415
  return vision_layout

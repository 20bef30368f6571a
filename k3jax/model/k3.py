"""The K3 language model: the hybrid KDA/MLA stack with Block AttnRes and LatentMoE.

Layer i (1-based) is MLA if i % mla_every == 0 (or last, with `final_mla`), else KDA; the
first `dense_layers` use the dense FFN, the rest LatentMoE: h -> AttnRes -> norm -> mixer ->
AttnRes -> norm -> FFN. Layers group into `prefix`, scanned `cycles` and `suffix`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.axes import constrain
from k3jax.media import PackedMedia
from k3jax.model import attn_res, embedding, layers, remat
from k3jax.model.kda import KDA
from k3jax.model.latent_moe import LatentMoE
from k3jax.model.mla import MLA
from k3jax.model.situ_glu import GLUMLP
from k3jax.model.vision import VisionTower, insert_features

@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Which mixer and FFN each layer uses, and how layers group into prefix/cycles/suffix."""
  mixers: tuple[str, ...]   # "kda" | "mla" per layer
  ffns: tuple[str, ...]     # "dense" | "moe" per layer
  prefix: int               # layers before the scanned cycles
  num_cycles: int           # scanned cycles of `cycle` layers each
  cycle: int

  @property
  def suffix(self) -> int:
    return len(self.mixers) - self.prefix - self.num_cycles * self.cycle


def layer_plan(cfg_model) -> LayerPlan:
  n, every = cfg_model.num_layers, cfg_model.mla_every
  mixers = tuple("mla" if i % every == 0 or (cfg_model.final_mla and i == n) else "kda"
                 for i in range(1, n + 1))
  ffns = tuple("dense" if i <= cfg_model.dense_layers else "moe" for i in range(1, n + 1))
  prefix = min(n, every) if cfg_model.dense_layers else 0
  num_cycles = (n - prefix) // every
  if num_cycles and mixers[prefix + num_cycles * every - 1] != "mla":
    raise AssertionError("a scanned cycle must end with its MLA layer")
  return LayerPlan(mixers, ffns, prefix, num_cycles, every)


class Layer(nnx.Module):
  """One decoder layer: token mixer then channel mixer, each read through AttnRes."""

  def __init__(self, cfg_model, mixer: str, ffn: str, *, rngs: nnx.Rngs):
    d, pdt = cfg_model.d_model, jnp.dtype(cfg_model.param_dtype)
    self.attn_res = cfg_model.attn_res.enabled
    self.block_sublayers = 2 * cfg_model.attn_res.block_layers
    if self.attn_res:
      query = functools.partial(attn_res.AttnResQuery, d, eps=cfg_model.norm_eps,
                                param_dtype=pdt, backend=cfg_model.attn_res.backend,
                                rngs=rngs)
      self.mixer_query, self.ffn_query = query(), query()
    self.mixer_norm = layers.RMSNorm(d, eps=cfg_model.norm_eps, param_dtype=pdt, rngs=rngs)
    self.mixer = KDA(cfg_model, rngs=rngs) if mixer == "kda" else MLA(cfg_model, rngs=rngs)
    self.ffn_norm = layers.RMSNorm(d, eps=cfg_model.norm_eps, param_dtype=pdt, rngs=rngs)
    if ffn == "moe":
      self.ffn = LatentMoE(cfg_model, rngs=rngs)
    else:
      f = cfg_model.ffn
      self.ffn = GLUMLP(d, f.hidden_dim, activation=f.activation, b1=f.situ_b1, b2=f.situ_b2,
                        recompute=remat.recomputes_activations(cfg_model.remat), rngs=rngs,
                        dtype=jnp.dtype(cfg_model.dtype), param_dtype=pdt)
    self.is_moe = ffn == "moe"
    self.is_mla = mixer == "mla"

  def _read(self, stream, query):
    if not self.attn_res:
      return stream
    with jax.named_scope("attn_res"):
      return attn_res.read(stream, query)

  def _write(self, stream, out):
    if not self.attn_res:
      return stream + out
    with jax.named_scope("attn_res"):
      return attn_res.write(stream, out, self.block_sublayers)

  def __call__(self, stream, segment_ids: jax.Array, valid: jax.Array):
    """stream: a BlockState (AttnRes) or the residual [B, T, d] -> (stream, aux)."""
    h = self._read(stream, self.mixer_query if self.attn_res else None)
    with jax.named_scope("mla" if self.is_mla else "kda"):
      out, aux = self.mixer(self.mixer_norm(h), segment_ids)
    stream = self._write(stream, remat.keep("layer_out", out))
    h = self._read(stream, self.ffn_query if self.attn_res else None)
    with jax.named_scope("moe" if self.is_moe else "ffn"):
      if self.is_moe:
        out, aux["moe"] = self.ffn(self.ffn_norm(h), valid)
      else:
        out = self.ffn(self.ffn_norm(h))
    return self._write(stream, remat.keep("layer_out", out)), aux

  def step(self, stream, cache: dict, pos: jax.Array):
    """One decoding token a row at pos [B] -> (stream, entry for `write_cache`)."""
    return self._decode(stream, lambda h: self.mixer.step(h, cache, pos))

  def write_cache(self, cache: dict, entry: dict, pos: jax.Array, index: tuple = ()) -> dict:
    """The cache after `step`'s token (the mixer's `write`)."""
    return self.mixer.write(cache, entry, pos, index)

  def prefill(self, stream, segment_ids: jax.Array, max_len: int):
    """Whole prompts -> (stream, the mixer's decoding cache of `max_len` positions)."""
    if self.is_mla:
      return self._decode(stream, lambda h: self.mixer.prefill(h, segment_ids, max_len))
    return self._decode(stream, lambda h: self.mixer.prefill(h, segment_ids))

  def _decode(self, stream, mixer):
    """The layer with `mixer(h) -> (out, cache)` as its token mixer; the FFN as always."""
    h = self._read(stream, self.mixer_query if self.attn_res else None)
    out, cache = mixer(self.mixer_norm(h))
    stream = self._write(stream, out)
    h = self._read(stream, self.ffn_query if self.attn_res else None)
    out = self.ffn(self.ffn_norm(h), None)[0] if self.is_moe else self.ffn(self.ffn_norm(h))
    return self._write(stream, out), cache

  def init_cache(self, batch: int, max_len: int, dtype) -> dict:
    if self.is_mla:
      return self.mixer.init_cache(batch, max_len, dtype)
    return self.mixer.init_cache(batch, dtype)


class Cycle(nnx.Module):
  """[KDA] * (mla_every - 1) + [MLA], every layer with LatentMoE: the scanned unit."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    every = cfg_model.mla_every
    self.layers = nnx.List([Layer(cfg_model, "kda" if j < every - 1 else "mla", "moe", rngs=rngs)
                            for j in range(every)])
    # remat_scope "layer": the cycle's backward holds one layer's activations at a time.
    self.layer_remat = ((cfg_model.remat, cfg_model.remat_save)
                        if cfg_model.remat_scope == "layer" else ("none", ""))

  def __call__(self, stream, segment_ids, valid):
    auxes = []
    for layer in self.layers:
      def run(s, layer=layer):
        return layer(s, segment_ids, valid)
      stream, aux = remat.wrap(run, *self.layer_remat)(stream)
      auxes.append(aux)
    return stream, auxes


class K3Model(nnx.Module):
  """tokens [B, T] int32, segment_ids [B, T] int32 (0 = padding) -> logits [B, T, vocab]."""

  def __init__(self, cfg_model, *, rngs: nnx.Rngs):
    self.plan = plan = layer_plan(cfg_model)
    # the names, not the policy: a function built per model would make equal configs'
    # graphdefs unequal
    self.remat, self.remat_save = cfg_model.remat, cfg_model.remat_save
    self.scan_layers = cfg_model.scan_layers
    self.use_attn_res = cfg_model.attn_res.enabled
    self.scan_saves = cfg_model.attn_res.scan_saves
    self.num_slots = attn_res.num_slots_for(cfg_model.num_layers, cfg_model.attn_res.block_layers)
    d, v, pdt = cfg_model.d_model, cfg_model.vocab_size, jnp.dtype(cfg_model.param_dtype)
    self.dtype = jnp.dtype(cfg_model.dtype)
    self.embed = layers.param(rngs, layers.normal(cfg_model.embed_init_std), (v, d),
                              ("vocab", "embed"), pdt)
    self.prefix = nnx.List([Layer(cfg_model, plan.mixers[i], plan.ffns[i], rngs=rngs)
                            for i in range(plan.prefix)])
    self.cycles = nnx.data(None)
    if plan.num_cycles:
      @nnx.split_rngs(splits=plan.num_cycles)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make_cycles(r):
        return Cycle(cfg_model, rngs=r)
      self.cycles = nnx.data(make_cycles(rngs))
    start = plan.prefix + plan.num_cycles * plan.cycle
    self.suffix = nnx.List([Layer(cfg_model, plan.mixers[i], plan.ffns[i], rngs=rngs)
                            for i in range(start, cfg_model.num_layers)])
    if cfg_model.attn_res.enabled:
      self.out_query = attn_res.AttnResQuery(d, eps=cfg_model.norm_eps, param_dtype=pdt,
                                             backend=cfg_model.attn_res.backend, rngs=rngs)
    self.final_norm = layers.RMSNorm(d, eps=cfg_model.norm_eps, param_dtype=pdt, rngs=rngs)
    self.lm_head = layers.Dense(d, v, ("embed", "vocab"), rngs=rngs, dtype=self.dtype,
                                param_dtype=pdt, muon=None)
    # MoonViT-V2 (K3_SPEC 6) when model.vision.enabled.
    self.vision = nnx.data(VisionTower(cfg_model, rngs=rngs) if cfg_model.vision.enabled
                           else None)
    self.placeholder_id = cfg_model.vision.placeholder_id

  def _remat(self, fn):
    return remat.wrap(fn, self.remat, self.remat_save)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array,
               media: PackedMedia | None = None):
    """Returns (logits [B, T, vocab] in the compute dtype, aux): `logits` of `hidden`."""
    h, aux = self.hidden(tokens, segment_ids, media)
    return self.logits(h), aux

  def logits(self, h: jax.Array) -> jax.Array:
    """The LM head: h [B, T, d] (`hidden`) -> logits [B, T, vocab] in the compute dtype."""
    return _head_logits(self.lm_head, h)

  def lm_head_fn(self):
    """(logits_fn, head): `logits` as logits_fn(head, h) of the LM head's parameters (a
    pytree), for a loss that differentiates the head itself."""
    graph, head = nnx.split(self.lm_head)
    return (lambda head, h: _head_logits(nnx.merge(graph, head), h)), head

  def hidden(self, tokens: jax.Array, segment_ids: jax.Array,
             media: PackedMedia | None = None):
    """(h [B, T, d] after the final norm, aux {"prefix", "cycles", "suffix"}: per layer
    "moe" stats or "logit_max", scanned ones stacked). media: None or `embed_with_images`'s."""
    valid = segment_ids > 0
    with jax.named_scope("embed"):
      if media is None:
        x = embedding.lookup(self.embed[...], tokens, self.dtype)
        x = constrain(x, ("batch", "seq", "embed"))
      else:
        x = self.embed_with_images(tokens, media)
    with jax.named_scope("attn_res"):
      stream = x
      if self.use_attn_res:   # unrolled: each source its own array, counts static
        stream = (attn_res.init_state(x, self.num_slots) if self.scan_layers
                  else attn_res.init_slots(x))

    def run_layer(layer, stream):
      return self._remat(lambda s: layer(s, segment_ids, valid))(stream)

    aux = {"prefix": [], "cycles": [], "suffix": []}
    for layer in self.prefix:
      stream, a = run_layer(layer, stream)
      aux["prefix"].append(a)
    if self.cycles is not None:
      graphdef, state = nnx.split(self.cycles)

      def body(stream, cycle_state):
        return nnx.merge(graphdef, cycle_state)(stream, segment_ids, valid)

      if not self.scan_layers:
        auxes = []
        for c in range(self.plan.num_cycles):
          stream, a = self._remat(body)(stream, jax.tree.map(lambda x, c=c: x[c], state))
          auxes.append(a)
        aux["cycles"] = jax.tree.map(lambda *xs: jnp.stack(xs), *auxes)
      elif self.use_attn_res and self.scan_saves == "partial":
        stream, aux["cycles"] = attn_res.scan(self._remat(body), stream, state)
      else:
        stream, aux["cycles"] = jax.lax.scan(self._remat(body), stream, state)
    for layer in self.suffix:
      stream, a = run_layer(layer, stream)
      aux["suffix"].append(a)

    with jax.named_scope("attn_res"):
      h = attn_res.read(stream, self.out_query) if self.use_attn_res else stream
    return constrain(self.final_norm(h), ("batch", "seq", "embed")), aux

  def unrolled_stacks(self, params):
    """Per leaf of `params` (`nnx.state(self, nnx.Param)`, Variables or values): the number
    of layers `hidden` slices one at a time out of its leading axis (the cycles, unrolled),
    else 0; None when it slices none (scanned, or no cycles)."""
    if self.scan_layers or self.cycles is None:
      return None
    n = self.plan.num_cycles
    return jax.tree_util.tree_map_with_path(
        lambda path, _: n if getattr(path[0], "key", None) == "cycles" else 0, params,
        is_leaf=lambda x: isinstance(x, nnx.Variable))

  def embed_images(self, media: PackedMedia) -> jax.Array:
    """Vision features [max_patches // merge**2, d] of packed media."""
    if self.vision is None:
      raise ValueError("K3Model.embed_images: model.vision.enabled is False")
    return self.vision(media)

  def embed_with_images(self, tokens: jax.Array, media: PackedMedia) -> jax.Array:
    """Embedding [B, T, d] with image features over the placeholders (one media or per row)."""
    x = embedding.lookup(self.embed[...], tokens, self.dtype)
    if jnp.ndim(media.patches) == 2:
      x = insert_features(x, tokens, self.embed_images(media), self.placeholder_id)
    else:
      feats = jax.vmap(self.embed_images)(media)                          # [B, K, d]
      insert_row = lambda e, t, f: insert_features(e[None], t[None], f,  # noqa: E731
                                                   self.placeholder_id)[0]
      x = jax.vmap(insert_row)(x, tokens, feats)
    return constrain(x, ("batch", "seq", "embed"))

  @staticmethod
  def reduce_aux(stacked):
    """Microbatch aux stacked on axis 0 -> the batch's: sums, and max for logit_max."""
    def reduce(path, x):
      if getattr(path[-1], "key", None) == "logit_max":
        return jnp.max(x, axis=0)
      return jnp.sum(x, axis=0)
    return jax.tree.map_with_path(reduce, stacked)

  def all_layers(self):
    """(group, index, Layer) for every layer; "cycles" Layers are stacked."""
    for group in ("prefix", "cycles", "suffix"):
      if group == "cycles":
        layers_ = self.cycles.layers if self.cycles is not None else ()
      else:
        layers_ = getattr(self, group)
      for i, layer in enumerate(layers_):
        yield group, i, layer

  def balance_loss(self, aux, tokens: jax.Array) -> jax.Array | None:
    """The aux_loss balancing term over `tokens` valid tokens, or None."""
    terms, weight = [], 0.0
    for group, i, layer in self.all_layers():
      if layer.is_moe and layer.ffn.balancing == "aux_loss":
        terms.append(jnp.ravel(aux[group][i]["moe"]["aux_loss"]))  # [cycles] when scanned
        weight = layer.ffn.aux_loss_weight
    if not terms:
      return None
    return weight * jnp.mean(jnp.concatenate(terms)) / tokens

  def update_balance(self, aux) -> dict[str, jax.Array]:
    """After an optimizer step: update every MoE bias; returns load statistics."""
    ratios, dropped = [], 0
    for group, i, layer in self.all_layers():
      if not layer.is_moe:
        continue
      moe_aux = aux[group][i]["moe"]
      layer.ffn.update_balance(moe_aux)
      load = moe_aux["load"].reshape(-1, layer.ffn.num_experts).astype(jnp.float32)
      ratios.append(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))
      dropped = dropped + jnp.sum(moe_aux["dropped"])
    if not ratios:
      return {}
    ratios = jnp.concatenate(ratios)
    return {"moe_max_load": jnp.max(ratios), "moe_mean_max_load": jnp.mean(ratios),
            "moe_dropped": dropped}

  def qk_clip(self, aux, tau: float) -> dict[str, jax.Array]:
    """After an optimizer step: QK-Clip every MLA layer (tau <= 0: report only)."""
    maxima, clipped = [], 0
    for group, i, layer in self.all_layers():
      if not layer.is_mla:
        continue
      logit_max = aux[group][i]["logit_max"]
      maxima.append(jnp.max(logit_max))
      if tau > 0:
        clipped = clipped + layer.mixer.clip_qk(logit_max, tau)
    if not maxima:
      return {}
    return {"mla_max_logit": jnp.max(jnp.stack(maxima)), "qk_clipped_heads": clipped}


def _head_logits(lm_head: layers.Dense, h: jax.Array) -> jax.Array:
  return constrain(lm_head(h), ("batch", "seq", "vocab"))

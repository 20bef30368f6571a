"""The training input pipeline, built from grain datasets.

  documents (sources.py) -> [bos] + ids + [eos] (tokenizer.py) -> next-token pieces of at
  most seq_len -> shuffle (per epoch; sources mixed by weight) -> packed rows -> global
  batches -> this process's rows

Elements: inputs, targets, segment_ids (0 = padding), positions [local_batch, seq_len] int32,
weights float32 (0 on padding and placeholders); with `data.images` also each row's
PackedMedia as media_* [B, ...]. Every process builds the same global batches and workers
only read pieces, so the iterator state resumes under any process or worker count."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence

import grain
import ml_collections
import numpy as np
from absl import flags

from k3jax import paths
from k3jax.data import sources as sources_lib
from k3jax.data import images as images_lib
from k3jax.data.config import check_config
from k3jax.data.corpus import default_documents
from k3jax.data.images import MediaSpec
from k3jax import media as k3media
from k3jax.data.pieces import DocumentPieces, Subset, TokenDocuments
from k3jax.data.shards import TokenShards
from k3jax.data.tokenizer import Tokenizer, make_tokenizer

FEATURES = ("inputs", "targets", "segment_ids", "positions", "weights")
# With data.images: the PackedMedia of each row (module docstring), as "media_" + field.
MEDIA_FEATURES = ("media_patches", "media_segment_ids", "media_coords", "media_grid_thw",
                  "media_pool_ids")
# data.worker_count > 0: consecutive pieces sent from a worker process in one transfer.
_PIECES_PER_CHUNK = 32


def _split_ids(n: int, split: str, every: int) -> np.ndarray:
  ids = np.arange(n)
  if split == "train":
    return ids if every == 0 else ids[ids % every != 0]
  return ids[ids % every == 0]


@functools.lru_cache(maxsize=8)
def _read_files(files: tuple[str, ...], mtimes: tuple[float, ...], spec_items: tuple,
                tokenizer: Tokenizer):
  """The documents of `files` (all of them), tokenized, in file order (cached per process)."""
  del mtimes  # part of the cache key: a changed file is read again
  spec = dict(spec_items)
  if spec["format"] == "arrayrecord":
    return TokenShards(files, tokenizer)
  return TokenDocuments([tokenizer.encode(doc)
                         for path in files for doc in sources_lib.read_documents(path, spec)])


def _file_documents(spec: dict, index: int, split: str, every: int, tokenizer: Tokenizer):
  field = f"config.data.sources[{index}]"
  use_heldout_files = bool(spec["validation_paths"])
  if split == "validation" and use_heldout_files:
    files = sources_lib.expand_paths(spec["validation_paths"], f"{field}.validation_paths")
  else:
    files = sources_lib.expand_paths(spec["paths"], f"{field}.paths")
  items = tuple((k, v) for k, v in sorted(spec.items()) if "paths" not in k)
  docs = _read_files(tuple(files), tuple(paths.mtime(f) for f in files), items, tokenizer)
  if use_heldout_files:
    return docs
  if split == "validation" and every == 0:
    raise ValueError(f"{field}: no validation documents: set its validation_paths, or "
                     f"config.data.heldout_every > 0")
  ids = _split_ids(len(docs), split, every)
  if not len(ids):
    raise ValueError(f"{field}: no {split} documents among its {len(docs)} "
                     f"(config.data.heldout_every={every})")
  return Subset(docs, ids)


def source_pieces(cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, seq_len: int,
                  split: str) -> list[tuple[DocumentPieces, float]]:
  """(pieces, weight) of every source of `split`, pieces in document order."""
  check_config(cfg)
  make = functools.partial(DocumentPieces, bos=tokenizer.bos_id, eos=tokenizer.eos_id,
                           seq_len=seq_len)
  if cfg.source == "none":
    return []
  if cfg.source == "default":
    docs = TokenDocuments([tokenizer.encode(d) for d in default_documents(split)])
    return [(make(docs), 1.0)]
  if split not in ("train", "validation"):
    raise ValueError(f"split must be one of ('train', 'validation'), got {split!r}")
  out = []
  for i, entry in enumerate(cfg.sources):
    spec = sources_lib.source_spec(entry, i)
    out.append((make(_file_documents(spec, i, split, cfg.heldout_every, tokenizer)),
                float(spec["weight"])))
  return out


def document_pieces(
    docs: Sequence[str], tokenizer: Tokenizer, seq_len: int
) -> list[dict[str, np.ndarray]]:
  """Every document as next-token pairs, cut into pieces of at most `seq_len`.
  Returns, in document order, dicts {"inputs": int32 [n], "targets": int32 [n]}
  with 1 <= n <= seq_len; a document of t tokens gives t + 1 pairs in all."""
  pieces = DocumentPieces(TokenDocuments([tokenizer.encode(d) for d in docs]),
                          bos=tokenizer.bos_id, eos=tokenizer.eos_id, seq_len=seq_len)
  return [pieces[i] for i in range(len(pieces))]


def _check_process(process_index: int, process_count: int):
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
        f"need 0 <= process_index < process_count, got {process_index} of {process_count}")


def _source_seed(seed: int, index: int) -> int:
  return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _as_map(source) -> grain.MapDataset:
  return source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)


def piece_dataset(
    cfg: ml_collections.ConfigDict,
    *,
    seq_len: int,
    seed: int,
    split: str = "train",
    num_epochs: int | None = None,
    media: MediaSpec | None = None,
) -> grain.MapDataset:
  """The shuffled, repeated stream of pieces before packing, the same on every process.
  Several sources when training: each shuffled and repeated, mixed by weight; image-text
  examples are the last source and text pieces gain empty media features."""
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}")
  check_config(cfg)
  tokenizer = make_tokenizer(cfg.tokenizer)
  parts = source_pieces(cfg, tokenizer, seq_len=seq_len, split=split)
  if cfg.images.source != "none":
    if media is None:
      raise ValueError("config.data.images is on: make_dataset needs media= "
                       "(MediaSpec.from_config(config.model.vision))")
    add_media = functools.partial(images_lib.no_media, patch_dim=media.patch_dim)
    parts = [(grain.MapDataset.source(p).map(add_media), w) for p, w in parts]
    examples = images_lib.ImageTextExamples(cfg.images, media, tokenizer, seq_len=seq_len,
                                            seed=seed, split=split,
                                            heldout_every=cfg.heldout_every)
    parts.append((examples, float(cfg.images.weight)))
  if len(parts) == 1 or num_epochs is not None or split != "train":
    ds = [_as_map(p) for p, _ in parts]
    ds = ds[0] if len(ds) == 1 else grain.MapDataset.concatenate(ds)
    return ds.shuffle(seed=seed).repeat(num_epochs)
  mixed = [_as_map(p).shuffle(seed=_source_seed(seed, i)).repeat(None)
           for i, (p, _) in enumerate(parts)]
  return grain.MapDataset.mix(mixed, [w for _, w in parts])


class _RestoreSliceTuples(grain.IterDataset):
  """Passes elements through; restores ConcatThenSplit's `remainder_slices` as tuples,
  since grain compares them with (-1, -1) and a JSON round trip makes them lists."""

  def __iter__(self) -> grain.DatasetIterator:
    return _RestoreSliceTuplesIterator(self._parent.__iter__())


class _RestoreSliceTuplesIterator(grain.DatasetIterator):

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    slices = {k: tuple(v) for k, v in state["remainder_slices"].items()}
    self._parent.set_state({**state, "remainder_slices": slices})


def _concat_pieces(pieces: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  out = {}
  for k in pieces[0]:
    out[k] = np.concatenate([p[k] for p in pieces])
    out[k + "@lengths"] = np.array([len(p[k]) for p in pieces], np.int64)
  return out


def _split_pieces(chunk: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
  """`_concat_pieces` undone, copied out of grain's shared memory."""
  keys = [k for k in chunk if not k.endswith("@lengths")]
  parts = {k: np.split(np.array(chunk[k]), np.cumsum(chunk[k + "@lengths"])[:-1])
           for k in keys}
  return [dict(zip(keys, values)) for values in zip(*(parts[k] for k in keys))]


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
  """In a worker: exit once the parent is gone."""
  del worker_index, worker_count
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(0)

  threading.Thread(target=watch, daemon=True, name="k3jax-exit-with-parent").start()


class _WorkerPieces(grain.IterDataset):
  """`pieces` in order, read ahead by `workers` processes; state {"next_index": i}."""

  def __init__(self, pieces: grain.MapDataset, workers: int, buffer_size: int):
    super().__init__()
    self._pieces, self._workers, self._buffer_size = pieces, workers, buffer_size

  def __iter__(self) -> grain.DatasetIterator:
    return _WorkerPiecesIterator(self._pieces, self._workers, self._buffer_size)


class _WorkerPiecesIterator(grain.DatasetIterator):

  def __init__(self, pieces: grain.MapDataset, workers: int, buffer_size: int):
    super().__init__()
    self._pieces, self._workers, self._buffer_size = pieces, workers, buffer_size
    self._next_index = 0
    self._chunks = None   # the worker processes' iterator over chunks, from _next_index
    self._ready = []      # pieces of the current chunk not yet returned

  def _start(self):
    if not flags.FLAGS.is_parsed():
      # grain reads an absl flag when starting workers, which raises before flags are parsed.
      flags.FLAGS.mark_as_parsed()
    chunks = self._pieces[self._next_index:].batch(_PIECES_PER_CHUNK, batch_fn=_concat_pieces)
    ds = chunks.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=self._workers, per_worker_buffer_size=self._buffer_size),
                        worker_init_fn=_exit_with_parent)
    self._chunks = ds.__iter__()

  def __next__(self) -> dict[str, np.ndarray]:
    if not self._ready:
      if self._chunks is None:
        self._start()
      chunk = next(self._chunks)
      self._ready = _split_pieces(chunk)
      del chunk
      self._ready.reverse()
    self._next_index += 1
    return self._ready.pop()

  def get_state(self) -> dict:
    return {"next_index": self._next_index}

  def set_state(self, state: dict) -> None:
    self._stop()
    self._next_index, self._ready = int(state["next_index"]), []

  def _stop(self) -> None:
    chunks, self._chunks = getattr(self, "_chunks", None), None
    if chunks is not None:
      chunks.close()

  def close(self) -> None:
    """Stops the worker processes (grain's `__del__` calls this when collected)."""
    self._stop()
    super().close()


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  segment_ids = packed["inputs_segment_ids"]
  return {
      "inputs": packed["inputs"],
      "targets": packed["targets"],
      "segment_ids": segment_ids,
      "positions": packed["inputs_positions"],
      "weights": (segment_ids > 0).astype(np.float32),
  }


def feature_shapes(cfg: ml_collections.ConfigDict, *, seq_len: int, batch: int,
                   media: MediaSpec | None = None) -> dict[str, tuple[tuple[int, ...], type]]:
  """{feature: (shape, numpy dtype)} of a `batch`-row element of `make_dataset`."""
  out = {k: ((batch, seq_len), np.float32 if k == "weights" else np.int32) for k in FEATURES}
  if cfg.images.source != "none" and media is not None:
    n, m = media.max_patches, media.max_media
    out.update(media_patches=((batch, n, media.patch_dim), np.float32),
               media_segment_ids=((batch, n), np.int32),
               media_coords=((batch, n, 3), np.int32),
               media_grid_thw=((batch, m, 3), np.int32),
               media_pool_ids=((batch, n // media.merge ** 2), np.int32))
  return out


def _media_row(packed: dict[str, np.ndarray], media: MediaSpec) -> dict[str, np.ndarray]:
  """A packed row's text features and the PackedMedia of its items, in row order."""
  row = _row(packed)
  row["weights"] *= (row["targets"] != media.placeholder_id)
  grids = packed["grid"][packed["grid_segment_ids"] > 0]
  items, start = [], 0
  for t, h, w in grids:
    n = int(t * h * w)
    items.append((packed["patches"][start:start + n], (int(t), int(h), int(w))))
    start += n
  packed_media, tokens = _pack(items, media)
  placeholders = int(np.sum(row["inputs"] == media.placeholder_id))
  if placeholders != sum(tokens):
    raise ValueError(f"a packed row holds {placeholders} placeholder tokens (id "
                     f"{media.placeholder_id}) for {sum(tokens)} image tokens: does the text "
                     f"itself contain the placeholder id?")
  row.update({"media_" + k: v for k, v in packed_media._asdict().items()})
  return row


def _pack(items, media: MediaSpec):
  packed, tokens = k3media.pack(items, max_patches=media.max_patches,
                                   max_media=media.max_media, merge=media.merge,
                                   temporal_pool=media.temporal_pool)
  if not items:   # a row of text only: pack cannot know the patch width
    packed = packed._replace(patches=np.zeros((media.max_patches, media.patch_dim), np.float32))
  return packed, tokens


def _stack_rows(rows: Sequence[dict[str, np.ndarray]], batch: int,
                media: MediaSpec | None = None) -> dict[str, np.ndarray]:
  """Stack rows into [batch, ...]; a short last batch gets all-padding rows (no media)."""
  if len(rows) < batch and media is not None:
    empty = {"media_" + k: v for k, v in _pack([], media)[0]._asdict().items()}
    rows = list(rows) + [{**{k: np.zeros_like(rows[0][k]) for k in FEATURES}, **empty}
                         for _ in range(batch - len(rows))]
  pad = batch - len(rows)
  names = FEATURES + (MEDIA_FEATURES if media is not None else ())
  stacked = {k: np.stack([r[k] for r in rows]) for k in names}
  return {k: np.pad(v, ((0, pad),) + ((0, 0),) * (v.ndim - 1)) for k, v in stacked.items()}


def make_dataset(
    cfg: ml_collections.ConfigDict,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
    num_epochs: int | None = None,
    media: MediaSpec | None = None,
) -> grain.IterDataset:
  """This process' `global_batch // process_count` rows of each global batch.
  `media`: needed when `cfg.images` is on. `num_epochs=None` repeats forever; else the last
  batch is padded. Worker processes start on the first `next`; `it.close()` stops them."""
  _check_process(process_index, process_count)
  if global_batch < 1 or global_batch % process_count:
    raise ValueError(
        f"global_batch={global_batch} must be a positive multiple of "
        f"process_count={process_count}")
  local_batch = global_batch // process_count
  if cfg.images.source == "none":
    media = None
  ds = piece_dataset(cfg, seq_len=seq_len, seed=seed, split=split, num_epochs=num_epochs,
                     media=media)
  if cfg.worker_count and split == "train":
    ds = _WorkerPieces(ds, cfg.worker_count, cfg.worker_buffer_size)
  else:
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  lengths = {"inputs": seq_len, "targets": seq_len}
  if media is not None:
    lengths.update(patches=media.max_patches, grid=media.max_media)
  if cfg.packing == "first_fit":
    # global_batch bins: every piece fits an empty bin, so each flush is one full batch.
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=global_batch, shuffle_bins=False)
  else:
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)
    ds = _RestoreSliceTuples(ds)
  ds = ds.map(_row if media is None else functools.partial(_media_row, media=media))
  ds = ds.batch(global_batch, batch_fn=functools.partial(_stack_rows, batch=global_batch,
                                                          media=media))
  rows = slice(process_index * local_batch, (process_index + 1) * local_batch)
  return ds.map(lambda batch: {k: v[rows] for k, v in batch.items()})

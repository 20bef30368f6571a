"""The training input pipeline, built from grain datasets.

  documents (config.data.source: the embedded corpus, or files: k3jax/data/sources.py)
    -> token ids (config.data.tokenizer: k3jax/data/tokenizer.py) -> [bos] + ids + [eos]
    -> per document: inputs = tok[:-1], targets = tok[1:]
    -> pieces of at most seq_len (each piece is its own segment)
    -> global shuffle with `seed`, reshuffled every epoch -> repeat
       (several sources: each shuffled and repeated, then mixed by their weights)
    -> packing into rows of seq_len -> global batches of global_batch rows
    -> process shard: process p of n keeps rows [p * local_batch, (p + 1) * local_batch)

The global batches do not depend on the number of processes: 2 processes x 4 devices train
on the very batches of 1 process x 8, and since every process is at the same position,
any one's iterator state (the checkpoint stores process 0's) resumes a run under any
process count. The price: every process reads the piece index of every source and packs
the whole global batch (numpy work, small next to a step).

Every element is a dict of numpy arrays, each [local_batch, seq_len]:
  inputs       int32   token ids fed to the model
  targets      int32   the next token of the same document
  segment_ids  int32   1, 2, ... per document piece in the row; 0 = padding
  positions    int32   0, 1, ... within each piece; 0 on padding
  weights      float32 1.0 where the target is a real token, 0.0 on padding

The returned `grain.IterDataset` is checkpointable: `it.get_state()` is a small
JSON-serialisable dict and `it.set_state(state)` on a fresh iterator resumes
with exactly the same batches.

`config.data.worker_count` > 0 reads the pieces (shuffle / mixture index lookup, reading
and decoding the source, cutting the piece) in that many worker processes (grain's
`mp_prefetch`), `_PIECES_PER_CHUNK` consecutive pieces per transfer; packing and batching
stay in this process. Packing is sequential (a batch starts where the previous one ended),
and grain's workers each pack their own slice, which would make the batches depend on the
worker count; reading before packing in the workers keeps every batch and every iterator
state the same under any worker count (0 included), so a checkpoint written with one count
resumes under another.

Image-text examples (`data.images`, k3jax/data/images.py; `make_dataset(..., media=)`)
are one more source, mixed with the text by `data.images.weight` (`data.source="none"`:
images only). Each element then also carries "patches" [n, P*P*3] (patchified here, in
the reading stage: worker processes when there are any) and "grid" [1, 3] ((t, h, w);
text pieces carry n = 0 and no grid row). First-fit packing fills every row within three
budgets at once: seq_len tokens, model.vision.max_patches patches, model.vision.max_media
items, and never cuts an image-text example. Each row then holds one PackedMedia of its
own items, in row order (`k3jax.media.pack`), so that its placeholders are its image
tokens in order; the batch gains, per row:
  media_patches      float32 [B, N, P*P*3]    N = max_patches, M = max_media, K = N / m**2
  media_segment_ids  int32   [B, N]
  media_coords       int32   [B, N, 3]
  media_grid_thw     int32   [B, M, 3]
  media_pool_ids     int32   [B, K]
and `weights` is 0 where the target is a placeholder (the loss is on the text). Every
array's leading axis is the batch row, so media shard, split into microbatches and into
processes exactly as the rows do.

Text files are read and tokenized when the pipeline is built (once per process; kept for
later calls, e.g. the validation split); prepared ArrayRecord shards are read lazily, piece
by piece, which is what corpora larger than memory need.
"""

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
  with 1 <= n <= seq_len; a document of t tokens gives t + 1 pairs in all.
  """
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
  """The shuffled, repeated stream of pieces, before packing (the same on every process).

  One source (or a finite `num_epochs`, or the validation split): all pieces, shuffled with
  `seed`; piece i of epoch e sits at index e * num_pieces + i. Several sources, training
  without end: each source's pieces shuffled (a seed per source) and repeated, then
  interleaved so that source j gives weight_j / sum(weights) of the pieces. With
  `data.images` the image-text examples are the last source (weight data.images.weight)
  and every text piece gains empty media features (`images.no_media`).
  """
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
  """Passes elements through; makes a JSON round trip of ConcatThenSplit's state harmless.

  grain 0.2.18's ConcatThenSplit compares each `remainder_slices` entry with the
  tuple (-1, -1). JSON (what grain's own CheckpointHandler writes) turns those
  tuples into lists, and the restored iterator would then replay a phantom
  remainder. This turns them back into tuples before restoring.
  """

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
  """A chunk of pieces as two arrays per feature, the pieces' values concatenated and
  their lengths (few shared-memory blocks per transfer)."""
  out = {}
  for k in pieces[0]:
    out[k] = np.concatenate([p[k] for p in pieces])
    out[k + "@lengths"] = np.array([len(p[k]) for p in pieces], np.int64)
  return out


def _split_pieces(chunk: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
  """`_concat_pieces` undone; copies out of grain's shared memory, which is freed as soon
  as the chunk goes."""
  keys = [k for k in chunk if not k.endswith("@lengths")]
  parts = {k: np.split(np.array(chunk[k]), np.cumsum(chunk[k + "@lengths"])[:-1])
           for k in keys}
  return [dict(zip(keys, values)) for values in zip(*(parts[k] for k in keys))]


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
  """In a worker process: exit once the process that started it is gone. grain stops its
  workers when the iterator is closed or collected, but a SIGKILLed trainer leaves them
  running (blocked on a full queue); a rerun after each kill would pile them up."""
  del worker_index, worker_count
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(0)

  threading.Thread(target=watch, daemon=True, name="k3jax-exit-with-parent").start()


class _WorkerPieces(grain.IterDataset):
  """The elements of `pieces` in order, read ahead by `workers` processes.

  The iterator's state is that of `pieces.to_iter_dataset()` ({"next_index": i}, the
  number of pieces consumed), whatever the worker count; `set_state` restarts the workers
  at piece i (they start on the first `next`, so a fresh iterator restored from a
  checkpoint starts them once).
  """

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
      # grain 0.2.18 reads one of its absl flags when it starts workers, which raises before
      # flags are parsed (tests, notebooks; absl.app parses them): every flag keeps its
      # default, which is what that read would get.
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
  """A packed row with media: the text features (weight 0 on placeholder targets) and the
  PackedMedia of the row's items, in row order."""
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

  `media` (from `model.vision`) is needed when `cfg.images` is on, and adds the media
  features (module docstring); it is ignored otherwise.
  `num_epochs=None` repeats forever (training); an integer gives a finite
  stream (e.g. 1 for one pass over the validation split) whose last batch is
  filled up with all-padding rows. `cfg.worker_count` > 0 (training split): pieces are read
  in worker processes, started by the iterator's first `next`; `it.close()` stops them
  (so does collecting the iterator, or the end of this process).
  """
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

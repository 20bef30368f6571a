"""Input data: the byte tokenizer, the embedded corpus and the grain pipeline."""

from k3jax.data.corpus import SPLITS, default_documents, unigram_entropy
from k3jax.data.pipeline import (
    FEATURES,
    PACKINGS,
    SOURCES,
    check_config,
    data_config,
    document_pieces,
    make_dataset,
    piece_dataset,
)
from k3jax.data.tokenizer import ByteTokenizer

__all__ = [
    "FEATURES",
    "PACKINGS",
    "SOURCES",
    "SPLITS",
    "ByteTokenizer",
    "check_config",
    "data_config",
    "default_documents",
    "document_pieces",
    "make_dataset",
    "piece_dataset",
    "unigram_entropy",
]

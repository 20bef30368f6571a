"""Input data: tokenizers, document sources, prepared shards and the grain pipeline."""

from k3jax.data.config import PACKINGS, SOURCES, check_config, data_config, validate_data
from k3jax.data.corpus import SPLITS, default_documents, unigram_entropy
from k3jax.data.images import IMAGE_SOURCES, MediaSpec
from k3jax.data.pipeline import (
    FEATURES,
    MEDIA_FEATURES,
    document_pieces,
    feature_shapes,
    make_dataset,
    piece_dataset,
    source_pieces,
)
from k3jax.data.sources import FORMATS
from k3jax.data.synthetic import synthetic_batch
from k3jax.data.tokenizer import (
    TOKENIZERS,
    ByteTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    check_vocab,
    make_tokenizer,
)

__all__ = [
    "FEATURES",
    "FORMATS",
    "IMAGE_SOURCES",
    "MEDIA_FEATURES",
    "PACKINGS",
    "SOURCES",
    "SPLITS",
    "TOKENIZERS",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "MediaSpec",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "check_config",
    "check_vocab",
    "data_config",
    "default_documents",
    "document_pieces",
    "feature_shapes",
    "make_dataset",
    "make_tokenizer",
    "piece_dataset",
    "source_pieces",
    "synthetic_batch",
    "unigram_entropy",
    "validate_data",
]

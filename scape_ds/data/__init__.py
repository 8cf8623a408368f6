"""The bundled corpus (World English Bible), the byte tokenizer and deterministic batches."""
from .corpus import (
    CORPUS_NAMES,
    ByteTokenizer,
    ByteWindows,
    build_datasets,
    build_splits,
    get_batch,
    load_corpus,
    unigram_entropy,
)

__all__ = [
    "CORPUS_NAMES",
    "ByteTokenizer",
    "ByteWindows",
    "build_datasets",
    "build_splits",
    "get_batch",
    "load_corpus",
    "unigram_entropy",
]

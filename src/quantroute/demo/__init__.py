"""The tiny demo model: a byte-level Llama trained on the standard library.

``build_demo`` trains it and writes ``f16`` / ``q8_0`` / ``q4_k_m`` GGUF
branches plus ``quantroute.yaml``; the packaged copy lives in
:data:`DEFAULT_REPO_DIR`. ``copy_gguf_with_metadata`` and
``perturb_gguf_weights`` make variants of any GGUF for tests.
torch is only needed to build, not to import this package.
"""

from __future__ import annotations

from quantroute.demo.builder import (
    DEFAULT_REPO_DIR,
    MODEL_NAME,
    SHIPPED_BRANCHES,
    BuildConfig,
    build_demo,
)
from quantroute.demo.data import Corpus, load_corpus
from quantroute.demo.gguf_export import (
    QUANTIZABLE,
    copy_gguf_with_metadata,
    perturb_gguf_weights,
    quantize_gguf,
    read_llama_gguf,
    read_metadata,
    write_llama_gguf,
)
from quantroute.demo.model import ModelConfig, TrainConfig, TrainResult
from quantroute.demo.vocab import VOCAB, ByteVocab

__all__ = [
    "DEFAULT_REPO_DIR",
    "MODEL_NAME",
    "QUANTIZABLE",
    "SHIPPED_BRANCHES",
    "VOCAB",
    "BuildConfig",
    "ByteVocab",
    "Corpus",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "build_demo",
    "copy_gguf_with_metadata",
    "load_corpus",
    "perturb_gguf_weights",
    "quantize_gguf",
    "read_llama_gguf",
    "read_metadata",
    "write_llama_gguf",
]

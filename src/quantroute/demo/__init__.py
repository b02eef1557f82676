"""The demo models: small Llamas trained here on the standard library.

- ``tiny-llama`` (354 byte tokens, 2 layers, 1.9 M params) is packaged:
  ``build_demo`` trains it and writes ``f16`` / ``q8_0`` / ``q4_k_m`` GGUF
  branches plus ``quantroute.yaml`` into :data:`DEFAULT_REPO_DIR`.
- ``stdlib-bpe-llama`` (32,000-token byte-level BPE, 8 layers, grouped-query
  attention, ChatML, 20.8 M params) has the shape of a real model and is too
  large for git: :func:`ensure_demo_repo` builds it once into a cache keyed by
  its inputs (``build_bpe_demo`` does the building) and returns the repository.

``copy_gguf_with_metadata`` and ``perturb_gguf_weights`` make variants of any
GGUF for tests. torch and tokenizers are only needed to build, not to import
this package.
"""

from __future__ import annotations

from quantroute.demo.bpe import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    BpeConfig,
    BpeVocab,
    train_bpe,
)
from quantroute.demo.bpe_builder import BPE_MODEL_NAME, BpeBuildConfig, build_bpe_demo
from quantroute.demo.builder import (
    DEFAULT_REPO_DIR,
    MODEL_NAME,
    SHIPPED_BRANCHES,
    BuildConfig,
    build_demo,
    write_branches,
)
from quantroute.demo.cache import (
    DEMO_MODELS,
    CacheKey,
    cache_key,
    default_cache_root,
    ensure_demo_repo,
)
from quantroute.demo.chats import ChatExample, chat_examples, chat_tokens
from quantroute.demo.data import Corpus, Source, load_corpus, select_sources
from quantroute.demo.gguf_export import (
    QUANTIZABLE,
    GgufVocab,
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
    "BPE_MODEL_NAME",
    "CHATML_TEMPLATE",
    "DEFAULT_REPO_DIR",
    "DEMO_MODELS",
    "MODEL_NAME",
    "QUANTIZABLE",
    "SHIPPED_BRANCHES",
    "SPECIAL_TOKENS",
    "VOCAB",
    "BpeBuildConfig",
    "BpeConfig",
    "BpeVocab",
    "BuildConfig",
    "ByteVocab",
    "CacheKey",
    "ChatExample",
    "Corpus",
    "GgufVocab",
    "ModelConfig",
    "Source",
    "TrainConfig",
    "TrainResult",
    "build_bpe_demo",
    "build_demo",
    "cache_key",
    "chat_examples",
    "chat_tokens",
    "copy_gguf_with_metadata",
    "default_cache_root",
    "ensure_demo_repo",
    "load_corpus",
    "perturb_gguf_weights",
    "quantize_gguf",
    "read_llama_gguf",
    "read_metadata",
    "select_sources",
    "train_bpe",
    "write_branches",
    "write_llama_gguf",
]

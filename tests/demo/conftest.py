"""Shared by the demo tests: llama.cpp's own tokenizer, loaded without weights."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


class LlamaVocab:
    """llama.cpp's tokenizer for a GGUF file, through the low-level API (``vocab_only``)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, *, add_special: bool = False, special: bool = False) -> list[int]:
        """``llama_tokenize``: ``add_special`` adds BOS, ``special`` parses special tokens."""
        data = text.encode()
        cap = len(data) + 8
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, special)
        assert n >= 0
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (nothing for a control token)."""
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 256, 0, False)
        return buf.raw[: max(n, 0)]

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


@pytest.fixture(scope="module")
def llama_vocab_of() -> Iterator[Callable[[Path], LlamaVocab]]:
    """Open llama.cpp's tokenizer for a GGUF file; closed when the module's tests end."""
    pytest.importorskip("llama_cpp")
    opened: list[LlamaVocab] = []

    def open_vocab(path: Path) -> LlamaVocab:
        opened.append(LlamaVocab(path))
        return opened[-1]

    yield open_vocab
    for v in opened:
        v.close()

"""The branch runners ``quantroute profile`` scores: one per engine, one interface.

A runner evaluates a batch of tokens from a position and returns the logits of the
rows asked for, as float32 ``[rows, V]``; ``clear`` empties its KV cache. The profiler
(``quality.profiler``) measures quality, memory and speed through this interface
alone, so a GGUF branch and an ONNX Runtime branch are measured by the same method:

- :class:`LlamaRunner`: a GGUF file through llama-cpp-python's low-level bindings
  (llama.cpp's default context parameters, as ``llama-perplexity`` and the serving
  worker use).
- :class:`OnnxRunner`: an ONNX Runtime branch (``engine: onnxruntime``) through the
  serving worker's own model class
  (:class:`~quantroute.engines.onnx.worker_model.OnnxModel`), one slot with a batch of
  a whole chunk, so the logits scored are the logits served.

Each is imported lazily by what needs it: llama-cpp-python when a runner is made,
ONNX Runtime only when an ONNX branch is profiled.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from quantroute.errors import ConfigError, EngineError

ONNX_ENGINE = "onnxruntime"  # the engine table's name for ONNX Runtime branches
TokenArray = npt.NDArray[np.int32]
Logits = npt.NDArray[np.float32]


class Runner(Protocol):
    """One branch loaded for scoring, with one sequence of at most ``n_ctx`` tokens.

    ``decode(tokens, pos0=, rows=(lo, hi))`` evaluates ``tokens`` at positions
    ``pos0, pos0+1, ...`` after what the cache holds (which must be exactly ``pos0``
    tokens) and returns the logits of batch rows ``[lo, hi)``, a fresh ``[hi-lo, V]``
    float32 array; raises :class:`~quantroute.errors.EngineError` if the engine fails.
    ``clear`` empties the cache. Not thread-safe; ``close`` (or ``with``) frees it.
    """

    n_vocab: int

    def clear(self) -> None: ...

    def decode(self, tokens: Sequence[int], *, pos0: int, rows: tuple[int, int]) -> Logits: ...

    def close(self) -> None: ...

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...


def open_runner(
    engine: str,
    path: Path,
    tokenizer: Path | None,
    *,
    n_ctx: int,
    n_threads: int,
    data: Path | None = None,
) -> Runner:
    """The runner of a branch run by ``engine`` (the manifest's ``engine:``): ``path``
    its file, ``tokenizer`` an ONNX branch's ``tokenizer.gguf``; ``ConfigError`` for an
    engine with no local runner or an ONNX branch without its tokenizer."""
    if engine == ONNX_ENGINE:
        if tokenizer is None:
            raise ConfigError(f"{path}: an {ONNX_ENGINE} branch needs its tokenizer")
        return OnnxRunner(path, tokenizer, n_ctx=n_ctx, n_threads=n_threads, data=data)
    if engine == "llamacpp":
        return LlamaRunner(path, n_ctx=n_ctx, n_threads=n_threads)
    raise ConfigError(f"{path}: quantroute profile has no local runner for engine {engine}")


def onnxruntime_version() -> str:
    """``onnxruntime X.Y.Z``, for the profile's method (imports ONNX Runtime)."""
    import onnxruntime  # type: ignore[import-untyped]

    return f"onnxruntime {onnxruntime.__version__}"


# ---- llama.cpp, through llama-cpp-python's low-level bindings ---------------------------------


class LlamaRunner:
    """One GGUF file loaded for scoring, with exact control of which logits are computed.

    ``vocab_only`` loads the tokenizer and metadata without weights or context.
    Not thread-safe; close it (or use ``with``) to free the model.
    """

    def __init__(
        self, path: Path, *, n_ctx: int = 0, n_threads: int = 1, vocab_only: bool = False
    ) -> None:
        import llama_cpp

        self._lib: Any = llama_cpp
        log = logging.getLogger("llama-cpp-python")
        if log.level == logging.NOTSET:  # its stderr printer is on unless told otherwise
            log.setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.vocab_only = vocab_only
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ConfigError(f"llama.cpp could not load {path}")
        self._ctx: Any = None
        self._batch: Any = None
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.n_ctx = n_ctx
        if vocab_only:
            return
        try:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
            params.n_seq_max = 1
            params.n_threads = params.n_threads_batch = n_threads
            params.no_perf = True
            self._ctx = llama_cpp.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise ConfigError(f"llama.cpp could not create a {n_ctx}-token context")
            self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        lib = self._lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or ``None`` if the file lacks it."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def n_ctx_train(self) -> int:
        value = self.meta(f"{self.meta('general.architecture')}.context_length")
        return int(value) if value and value.isdigit() else 0

    def tokenize(self, text: str) -> TokenArray:
        """Tokens of ``text``, BOS first if the model adds one, as ``common_tokenize(.., true)``."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self._lib.llama_token * cap)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, True, False)
        if n < 0:
            raise ConfigError(f"tokenizing the calibration text needs {-n} tokens, over {cap}")
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32)  # [N]

    def clear(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def decode(
        self, tokens: Sequence[int], *, pos0: int, rows: tuple[int, int]
    ) -> npt.NDArray[np.float32]:
        """Evaluate ``tokens`` at positions ``pos0..``; return logits of batch rows ``[lo, hi)``.

        Only those rows' logits are computed, as llama-perplexity requests them: ``[hi-lo, V]``.
        """
        lo, hi = rows
        n = len(tokens)
        b = self._batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if lo <= i < hi else 0
        ret = self._lib.llama_decode(self._ctx, b)
        if ret != 0:
            raise EngineError(f"llama_decode returned {ret} for {n} tokens at position {pos0}")
        ptr = ctypes.cast(self._lib.llama_get_logits(self._ctx), ctypes.POINTER(ctypes.c_float))
        out: npt.NDArray[np.float32] = np.ctypeslib.as_array(ptr, shape=(hi - lo, self.n_vocab))
        return out.copy()  # [hi-lo, V]; llama.cpp reuses its buffer on the next decode


# ---- ONNX Runtime, through the serving worker's model ---------------------------------------


class OnnxRunner:
    """An ONNX Runtime branch loaded for scoring: ``model.onnx`` and its
    ``tokenizer.gguf`` in the serving worker's
    :class:`~quantroute.engines.onnx.worker_model.OnnxModel` — one slot of ``n_ctx``
    cells and a batch of ``n_ctx`` entries, so a chunk is one step, as a prompt of that
    length is served. Rows are asked for entry by entry (``put``); where the graph takes
    ``logits_to_keep`` it computes only those from the first one asked for, as the
    worker does.

    ``ConfigError`` (in the worker's words) if the folder cannot be loaded. ``close``
    drops the session; the vocabulary's llama.cpp handle lives until the process ends
    (the profiler's child is short-lived, and the worker's model frees none either).
    """

    def __init__(
        self, path: Path, tokenizer: Path, *, n_ctx: int, n_threads: int, data: Path | None = None
    ) -> None:
        from quantroute.engines.llamacpp.worker_model import LoadError
        from quantroute.engines.onnx.worker_model import OnnxModel

        try:
            self._model: Any = OnnxModel(
                str(path),
                str(tokenizer),
                n_ctx=n_ctx,
                parallel=1,
                n_batch=n_ctx,
                n_threads=n_threads,
                data=None if data is None else str(data),
            )
        except LoadError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        self.n_vocab = int(self._model.n_vocab)
        self.n_ctx = n_ctx

    def close(self) -> None:
        self._model = None

    def __enter__(self) -> OnnxRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear(self) -> None:
        self._model.clear(0)

    def decode(self, tokens: Sequence[int], *, pos0: int, rows: tuple[int, int]) -> Logits:
        """As :meth:`LlamaRunner.decode`: the logits of batch rows ``[lo, hi)``, ``[hi-lo, V]``."""
        lo, hi = rows
        model = self._model
        for i, tok in enumerate(tokens):
            model.put(i, int(tok), pos0 + i, 0, lo <= i < hi)
        status = model.decode(len(tokens))
        if status != 0:
            raise EngineError(
                f"onnxruntime decode of {len(tokens)} tokens at position {pos0} failed: "
                f"{model.decode_failure(status)}"
            )
        view, _ = model.rows(hi - lo)  # [hi-lo, V], valid until the next decode
        return np.array(view, dtype=np.float32)  # [hi-lo, V], a copy

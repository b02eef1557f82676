"""The model a worker serves (worker process): its vocabulary, the batch each decode step
fills and the KV cells of one sequence per slot.

:class:`WorkerModel` is the contract the worker's modules are written against
(``worker_admission``, ``worker_batch``, ``worker_sequence``); :class:`Model` meets it
with llama.cpp's C API (a GGUF file, through llama-cpp-python's ctypes bindings),
``engines/onnx/worker_model.py``'s ``OnnxModel`` with an ONNX Runtime session. Both take
their vocabulary from llama.cpp (:class:`Vocabulary`), so tokens, pieces, end-of-generation
and the grammar sampler's ``vocab`` are llama.cpp's own whichever computes the logits.
Nothing here knows of requests.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import TYPE_CHECKING, Any, Protocol

import llama_cpp as lc
import numpy as np

from quantroute.engines.base import EngineInfo

if TYPE_CHECKING:
    from quantroute.engines.llamacpp.sampler_chain import SamplerChain

_GGML_LOG_LEVEL_ERROR = 3

Rows = tuple[np.ndarray[Any, Any], int]
"""A step's rows of logits as one view (``[n, V]``), and what locates an entry's row in it."""


class LoadError(RuntimeError):
    """The worker's files could not be loaded; the words say which and why (the worker
    sends them to the gateway as its first line, then exits)."""


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _ERRORS_ONLY_LOG(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


def llama_init(quiet: bool) -> None:
    """llama.cpp's backend, its log cut to errors when ``quiet``."""
    lc.llama_backend_init()
    if quiet:
        lc.llama_log_set(_ERRORS_ONLY_LOG, ctypes.c_void_p(0))


class WorkerModel(Protocol):
    """What the worker's modules use of the model it serves.

    The batch is llama.cpp's: :meth:`put` entries ``0..n-1`` (a decoding sequence's one
    token, a slice of a prompt), :meth:`decode` them together, then read the rows of
    logits the entries asked for: by entry index (:meth:`row`, :meth:`sample`), or all of
    this step's as one view in batch order (:meth:`rows`, :meth:`row_in`). A slot's KV
    cells are positions ``0..n-1``: entries of a slot continue from its last cell; the
    prompt cache keeps a prefix (:meth:`keep_prefix`) or drops them all (:meth:`clear`).
    """

    vocab: Any  # llama.cpp's vocabulary (the grammar sampler reads it)
    n_vocab: int
    n_ctx: int  # cells per slot
    n_ctx_train: int
    n_batch: int  # batch entries per decode, at most
    parallel: int  # slots
    eog_tokens: list[int]
    eog_set: frozenset[int]

    def info(self) -> EngineInfo: ...
    def tokenize(self, text: str, special: bool, bos: bool = True) -> list[int]: ...
    def fewest_tokens(self, text: str) -> int: ...
    def piece_bytes(self, token: int, special: bool = False) -> bytes: ...
    def piece(self, token: int, special: bool = False) -> str: ...
    def is_eog(self, token: int) -> bool: ...
    def put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None: ...

    def decode(self, n: int) -> int:
        """Decode entries ``0..n-1``: 0 done; 1 a slot has no room (or the KV cache, none
        for the batch); -2 memory for the step could not be allocated; another: failed."""
        ...

    def decode_failure(self, status: int) -> str:
        """What a failed :meth:`decode` status means, in words."""
        ...

    def row(self, index: int) -> np.ndarray[Any, Any]: ...
    def rows(self, n: int) -> Rows: ...
    def row_in(self, rows: Rows, index: int) -> np.ndarray[Any, Any]: ...

    def sample(self, chain: SamplerChain, index: int) -> int:
        """``chain``'s token from entry ``index``'s row (the chain accepts it)."""
        ...

    def keep_prefix(self, slot: int, keep: int) -> bool: ...
    def clear(self, slot: int) -> None: ...


class Vocabulary:
    """A llama.cpp model's vocabulary: tokens, their pieces, end-of-generation, the chat
    template. ``handle`` is a loaded ``llama_model`` (a whole GGUF, or one loaded
    ``vocab_only``)."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.vocab = lc.llama_model_get_vocab(handle)
        self.n_vocab: int = lc.llama_vocab_n_tokens(self.vocab)
        self.eog_tokens = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self.eog_set = frozenset(self.eog_tokens)
        self._piece_buf = ctypes.create_string_buffer(256)
        # The longest token's text: a prompt of B bytes has at least B / this many tokens,
        # so one that cannot fit the context is refused without tokenizing it (llama.cpp's
        # tokenizer is quadratic in some long runs: 100 s for a megabyte of one character).
        self.max_piece_bytes = max(
            1, max((len(self.piece_bytes(t, True)) for t in range(self.n_vocab)), default=1)
        )

    def meta(self, key: str) -> str | None:
        """The GGUF metadata value ``key`` as text, ``None`` where the file has none."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            n = lc.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def vocab_info(self, n_ctx: int, n_ctx_train: int, parallel: int, nbytes: int) -> EngineInfo:
        """The engine info of a model with this vocabulary."""
        template = lc.llama_model_chat_template(self.handle, None)
        return EngineInfo(
            n_ctx=n_ctx,
            n_ctx_train=n_ctx_train,
            n_vocab=self.n_vocab,
            parallel=parallel,
            chat_template=template.decode("utf-8", "replace") if template else None,
            bos_token=self.piece(lc.llama_vocab_bos(self.vocab), special=True),
            eos_token=self.piece(lc.llama_vocab_eos(self.vocab), special=True),
            model_bytes=nbytes,
            pid=os.getpid(),
        )

    def tokenize(self, text: str, special: bool, bos: bool = True) -> list[int]:
        """``text``'s tokens, BOS first unless ``bos`` is false (called from the
        tokenizer threads too)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, bos, special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, bos, special)
        return list(buf[:n])

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can be: its bytes over the longest token's."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_piece_bytes)

    def piece_bytes(self, token: int, special: bool = False) -> bytes:
        n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n >= 0:
            return self._piece_buf.raw[:n]
        buf = ctypes.create_string_buffer(-n)  # a longer piece: -n bytes, asked again
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def piece(self, token: int, special: bool = False) -> str:
        return self.piece_bytes(token, special).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))


class Model(Vocabulary):
    """A GGUF file loaded with a context of ``parallel`` sequences of ``n_ctx`` cells
    each (``n_ctx`` 0: the model's training context), and a batch of ``n_batch``."""

    def __init__(
        self,
        path: str,
        *,
        n_ctx: int = 0,
        parallel: int = 4,
        n_batch: int = 512,
        n_threads: int = 0,
        n_gpu_layers: int = 0,
        quiet: bool = True,
    ):
        llama_init(quiet)
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        handle = lc.llama_model_load_from_file(path.encode(), mparams)
        if not handle:
            raise LoadError("llama.cpp could not load the model file (its log says why)")
        super().__init__(handle)
        self.n_ctx_train: int = lc.llama_model_n_ctx_train(self.handle)
        self.n_ctx: int = n_ctx or self.n_ctx_train
        self.parallel = parallel
        self.n_batch = n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self.n_ctx * self.parallel
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.parallel
        cparams.kv_unified = False  # each sequence owns n_ctx cells
        threads = n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.handle, cparams)
        if not self.ctx:
            raise LoadError("llama.cpp could not create a context")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def info(self) -> EngineInfo:
        nbytes = int(lc.llama_model_size(self.handle))
        return self.vocab_info(self.n_ctx, self.n_ctx_train, self.parallel, nbytes)

    # -- the batch and its logits ---------------------------------------------

    def put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        """Batch entry ``i``: ``token`` at ``pos`` of sequence ``slot``; ``logits``: keep
        the row that predicts what follows it."""
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = slot
        b.logits[i] = logits

    def decode(self, n: int) -> int:
        """Decode the batch's first ``n`` entries; llama.cpp's status (0: done; 1: no KV
        room for the batch; -2: a compute buffer could not be allocated)."""
        self.batch.n_tokens = n
        return int(lc.llama_decode(self.ctx, self.batch))

    def decode_failure(self, status: int) -> str:
        if status in (1, -2):
            return "out of memory in llama_decode (no room for the batch)"
        return f"llama_decode returned {status}"

    def row(self, index: int) -> np.ndarray[Any, Any]:
        """The logits batch entry ``index`` asked for, where llama.cpp holds them. # [V]"""
        ptr = lc.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def rows(self, n: int) -> Rows:
        """This step's ``n`` rows of logits (one per entry that asked for them) as one view,
        and the address of the first. # [n, V]"""
        base = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(base, shape=(n, self.n_vocab)), ctypes.addressof(base.contents)

    def row_in(self, rows: Rows, index: int) -> np.ndarray[Any, Any]:
        """Entry ``index``'s row within :meth:`rows`' view (writable: llama.cpp's buffer,
        read by nothing else before the next decode). # [V]"""
        view, base = rows
        ptr = lc.llama_get_logits_ith(self.ctx, index)
        return view[(ctypes.addressof(ptr.contents) - base) // (4 * self.n_vocab)]  # type: ignore[no-any-return]

    def sample(self, chain: SamplerChain, index: int) -> int:
        """``chain``'s token from entry ``index``'s row, read where llama.cpp holds it."""
        return chain.sample(self.ctx, index)

    # -- KV cells ---------------------------------------------------------------

    def keep_prefix(self, slot: int, keep: int) -> bool:
        """Drop ``slot``'s cells from position ``keep`` on; False where the memory cannot
        cut a sequence in the middle (recurrent models)."""
        return bool(lc.llama_memory_seq_rm(self.mem, slot, keep, -1))

    def clear(self, slot: int) -> None:
        lc.llama_memory_seq_rm(self.mem, slot, -1, -1)

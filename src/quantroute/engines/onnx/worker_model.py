"""The model an ONNX Runtime worker serves (worker process): the llama.cpp worker's
:class:`~quantroute.engines.llamacpp.worker_model.WorkerModel`, its forward pass an
ONNX Runtime session over a decoder folder's ``model.onnx``.

Everything but the forward pass is the llama.cpp worker's, unchanged: admission,
continuous batching, sampling (llama.cpp's sampler chain, over the row given to it:
``SamplerChain.draw``), grammars, stops, logprobs, scoring, the prompt cache, the wire.
The vocabulary is llama.cpp's own, loaded ``vocab_only`` from the folder's
``tokenizer.gguf`` (:class:`~quantroute.engines.llamacpp.worker_model.Vocabulary`), so
tokens, pieces, end-of-generation, the chat template and the grammar sampler's ``vocab``
are those of the GGUF the folder was exported from.

The graph speaks :mod:`quantroute.engines.onnx.layout`'s key/value-cache interface
(Optimum's and onnxruntime-genai's): its shape (layers, KV heads, head size, KV dtype,
vocabulary) is read from the session's inputs and outputs, so any such export runs.

The KV cells of each slot are numpy arrays here, ``[2 * n_layer, n_kv_heads, cells,
head_dim]`` (each layer's key, then its value), grown as the slot fills, up to ``n_ctx``.
:meth:`OnnxModel.decode` groups the batch's entries by slot (a prompt slice, or a
decoding sequence's one token) and runs the slots together in one call, each row
left-padded: the new tokens right-aligned in ``T`` (the most any slot brings), the past
right-aligned in ``P`` (the longest any slot holds), ``attention_mask`` 0 on padding,
``position_ids`` the entries' positions. The presents are split back per slot, padding
trimmed, and the rows of logits the entries asked for kept in batch order, as
``llama_get_logits`` keeps them; where the graph takes ``logits_to_keep``, it computes
only each row's last ones, from the first any slot asks for (a prompt slice asks for its
last token's alone: one row, not ``T``). One exception to the one call: a step that
mixes decoding sequences' single tokens with a prompt slice long enough that padding
would more than double the rows computed runs the single tokens as a second call (every
row of a call is ``T`` long: a sequence padded to a 500-token prompt costs 500 tokens'
work).

ONNX Runtime loads the model from the file itself, never from bytes read here: the worker
opens the path it was given once (a plain path, or ``/proc/self/fd/N``, the descriptor
the gateway opened and verified by sha256) and hands ONNX Runtime that open file's
``/proc/self/fd/M``. Opening a ``/proc/self/fd`` entry opens the inode the descriptor
holds, not whatever the folder names now: a file renamed over ``model.onnx`` after the
gateway verified it is not what loads, so the session serves exactly the verified
bytes, and the size the worker reports (``fstat``) is that file's. From bytes, the
Python session would keep them for its life (one copy of the weights, ``W``, more
resident; 1 to 1.5 W more at the load's peak; ``docs/memory-model.md``). Only the ONNX
format loads (``session.load_model_format``), whatever the bytes say. Once the session
is built, the heap its load freed goes back to the system (glibc's ``malloc_trim``:
glibc would keep ~0.4 W, ~1.1 W for a float16 graph).

A folder whose weights lie beside ``model.onnx`` (``model.onnx.data``, ONNX external
data: past 1.5 GiB) is given as two files, the graph and ``data`` (the gateway's
verified descriptors, or paths). ONNX Runtime finds external data by the name the graph
records, relative to the graph's folder; beside ``/proc/self/fd/M`` there is no such
folder, and links to ``/proc/self/fd`` entries do not do (it resolves each path to its
canonical name, which for a file renamed over since is a ``... (deleted)`` that does
not exist). So the worker opens both files, reads the name the graph's external tensors
give (``registry.onnx_check.external_location``, bounded reads of the graph: the
registry checked it is the declared file's, and each tensor lies inside it), maps the
data descriptor read-only and hands ONNX Runtime that mapping under that name
(``add_external_initializers_from_files_in_memory``): it copies each tensor's bytes out
of the mapping while it builds the session (the mapping's pages are the file's own, not
a copy, and are unmapped once the session is built), so the session holds exactly the
verified bytes whatever the folder names now. Without ``data``, a graph with external
data is refused by ONNX Runtime, in words.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]

from quantroute.engines.base import EngineInfo
from quantroute.engines.llamacpp.worker_model import LoadError, Rows, Vocabulary, llama_init
from quantroute.engines.onnx.layout import LOGITS_TO_KEEP, MODEL_FILE, past_names, present_names
from quantroute.errors import ArtifactIntegrityError

if TYPE_CHECKING:
    from quantroute.engines.llamacpp.sampler_chain import SamplerChain

log = logging.getLogger(__name__)

_KV_TYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
}
_ORT_ERRORS_ONLY = 3  # ONNX Runtime's log severity: errors and worse
_MIN_CELLS = 64  # a slot's first KV arrays hold this many cells (they double as it fills)


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What a decoder graph's inputs and outputs say of the model."""

    n_layer: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int | None  # None: the logits' last dimension is symbolic
    kv_dtype: np.dtype[Any]

    @classmethod
    def of(cls, session: Any) -> GraphShape:
        """Read it from ``session``; raises :class:`LoadError`, in words, for a graph
        that is not a decoder with a key/value cache."""
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        n_layer = 0
        while past_names(n_layer)[0] in inputs:
            n_layer += 1
        missing = [n for n in ("input_ids", "attention_mask", "position_ids") if n not in inputs]
        missing += [] if n_layer else [past_names(0)[0]]
        missing += [n for n in ("logits", *present_names(0)) if n not in outputs]
        wanted = [n for i in range(n_layer) for n in (*past_names(i), *present_names(i))]
        missing += [n for n in wanted if n not in inputs and n not in outputs]
        if missing:
            raise LoadError(
                "model.onnx is not a decoder with a key/value cache (layout.py's interface): "
                f"it has no {', '.join(missing)}"
            )
        past = inputs[past_names(0)[0]]
        shape, logits = past.shape, outputs["logits"].shape
        if (
            len(shape) != 4
            or not isinstance(shape[1], int)
            or not isinstance(shape[3], int)
            or past.type not in _KV_TYPES
            or len(logits) != 3
        ):
            raise LoadError(
                f"model.onnx's {past.name} is {past.type} {shape}, not float or float16 "
                "[batch, n_kv_heads, past, head_dim] with fixed heads and head size"
            )
        n_vocab = logits[2] if isinstance(logits[2], int) else None
        return cls(n_layer, shape[1], shape[3], n_vocab, _KV_TYPES[past.type])


class OnnxModel(Vocabulary):
    """``model.onnx`` in an ONNX Runtime session (CPU; CUDA's provider first where asked
    for, ``n_gpu_layers`` non-zero, and installed), ``tokenizer.gguf``'s vocabulary, and
    ``parallel`` slots of ``n_ctx`` cells each (``n_ctx`` 0: the training context the
    tokenizer's metadata gives). A batch holds ``n_batch`` entries. ``data``: the graph's
    external data file (``model.onnx.data``; module docstring)."""

    def __init__(
        self,
        path: str,
        tokenizer: str,
        *,
        n_ctx: int = 0,
        parallel: int = 4,
        n_batch: int = 512,
        n_threads: int = 0,
        n_gpu_layers: int = 0,
        quiet: bool = True,
        data: str | None = None,
    ):
        llama_init(quiet)
        params = lc.llama_model_default_params()
        params.vocab_only = True
        handle = lc.llama_model_load_from_file(tokenizer.encode(), params)
        if not handle:
            raise LoadError("llama.cpp could not load the tokenizer (tokenizer.gguf)")
        super().__init__(handle)
        arch = self.meta("general.architecture") or ""
        self.n_ctx_train = int(self.meta(f"{arch}.context_length") or 0)
        self.n_ctx = n_ctx or self.n_ctx_train
        if self.n_ctx <= 0:
            raise LoadError("tokenizer.gguf gives no context length: set the branch's n_ctx")
        self.parallel = parallel
        self.n_batch = n_batch
        self.model_bytes, self.session = _load(
            path, n_threads or os.cpu_count() or 1, n_gpu_layers != 0, quiet, data
        )
        self.shape = shape = GraphShape.of(self.session)
        if shape.n_vocab is not None and shape.n_vocab != self.n_vocab:
            raise LoadError(
                f"model.onnx's vocabulary ({shape.n_vocab} logits) is not tokenizer.gguf's "
                f"({self.n_vocab} tokens)"
            )
        self._past = [n for i in range(shape.n_layer) for n in past_names(i)]
        # the graph computes only the last K rows of logits when told (an optional input)
        inputs = [*self.session.get_inputs(), *self.session.get_overridable_initializers()]
        self._keeps_rows = any(i.name == LOGITS_TO_KEEP for i in inputs)
        self._outputs = ["logits", *(n for i in range(shape.n_layer) for n in present_names(i))]
        # the batch: what put() wrote, entry by entry
        self._tokens = np.zeros(n_batch, dtype=np.int64)
        self._pos = np.zeros(n_batch, dtype=np.int64)
        self._slot = np.zeros(n_batch, dtype=np.int64)
        self._wants = np.zeros(n_batch, dtype=np.bool_)
        # the last decode's rows of logits, in batch order, and each entry's row (-1: none)
        self._logits = np.zeros((0, self.n_vocab), dtype=np.float32)  # [n_out, V]
        self._row_of = np.full(n_batch, -1, dtype=np.int64)
        # each slot's KV cells: [2 * n_layer, n_kv_heads, capacity, head_dim], and how
        # many of them hold tokens (positions 0..n-1)
        self._kv: list[np.ndarray[Any, Any] | None] = [None] * parallel
        self._cells = [0] * parallel
        self._failure = ""

    def info(self) -> EngineInfo:
        return self.vocab_info(self.n_ctx, self.n_ctx_train, self.parallel, self.model_bytes)

    # -- the batch and its logits ---------------------------------------------

    def put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        """Batch entry ``i``: ``token`` at ``pos`` of ``slot``; ``logits``: keep its row."""
        self._tokens[i] = token
        self._pos[i] = pos
        self._slot[i] = slot
        self._wants[i] = logits

    def decode(self, n: int) -> int:
        """Decode entries ``0..n-1`` (module docstring). 1: a slot has no room for its
        entries; -2: numpy could not allocate the step; -1: ONNX Runtime failed, or the
        entries do not continue their slots (:meth:`decode_failure` says which)."""
        self._failure = ""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(self._slot[:n].tolist()):
            groups.setdefault(slot, []).append(i)
        for slot, entries in groups.items():
            held, k = self._cells[slot], len(entries)
            if held + k > self.n_ctx:
                self._failure = f"slot {slot} has no room: {held} + {k} cells > n_ctx {self.n_ctx}"
                return 1
            if self._pos[entries].tolist() != list(range(held, held + k)):
                self._failure = f"the entries of slot {slot} do not continue its {held} cells"
                return -1
        wants = self._wants[:n]
        self._row_of[:n] = np.where(wants, np.cumsum(wants) - 1, -1)
        try:
            self._logits = np.empty((int(wants.sum()), self.n_vocab), dtype=np.float32)
            for call in _calls(list(groups.items()), n):
                self._run(call)
        except MemoryError:
            self._failure = "out of memory: numpy could not allocate the step's arrays"
            return -2
        except Exception as exc:  # ONNX Runtime's errors share no base but Exception
            self._failure = f"onnxruntime failed: {type(exc).__name__}: {exc}"
            log.error("%s", self._failure)
            return -1
        return 0

    def decode_failure(self, status: int) -> str:
        if self._failure:
            return self._failure
        return "out of memory (no room for the batch)" if status in (1, -2) else f"status {status}"

    def _run(self, call: list[tuple[int, list[int]]]) -> None:
        """One session run over ``call``'s slots (each with its entries, in batch order)."""
        shape = self.shape
        b_n = len(call)
        t_n = max(len(entries) for _, entries in call)  # new tokens, right-aligned
        p_n = max(self._cells[slot] for slot, _ in call)  # past cells, right-aligned
        ids = np.zeros((b_n, t_n), dtype=np.int64)  # [B, T]; padding: token 0, masked
        positions = np.zeros((b_n, t_n), dtype=np.int64)
        mask = np.zeros((b_n, p_n + t_n), dtype=np.int64)  # [B, P+T]
        # zeros, not empty: a masked value still meets a probability of 0 (0 * nan is nan)
        past = np.zeros(
            (2 * shape.n_layer, b_n, shape.n_kv_heads, p_n, shape.head_dim), shape.kv_dtype
        )  # [2L, B, Hkv, P, hd]
        for b, (slot, entries) in enumerate(call):
            held, k = self._cells[slot], len(entries)
            ids[b, t_n - k :] = self._tokens[entries]
            positions[b, t_n - k :] = self._pos[entries]
            mask[b, p_n - held : p_n] = 1
            mask[b, p_n + t_n - k :] = 1
            kv = self._kv[slot]
            if held and kv is not None:
                past[:, b, :, p_n - held :] = kv[:, :, :held]
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        feeds.update(zip(self._past, past, strict=True))
        if self._keeps_rows:  # the rows from the first one any slot asks for (0 would be all)
            feeds[LOGITS_TO_KEEP] = np.array(max(1, *(self._tail(e) for _, e in call)))
        logits, *presents = self.session.run(self._outputs, feeds)  # [B, K, V], [B, Hkv, P+T, hd]
        skipped = t_n - logits.shape[1]  # the rows not computed, of T
        for b, (slot, entries) in enumerate(call):
            held, k = self._cells[slot], len(entries)
            kv = self._reserve(slot, held + k)
            for j, present in enumerate(presents):
                kv[j, :, held : held + k] = present[b, :, p_n + t_n - k :]
            self._cells[slot] = held + k
            for t, i in enumerate(entries):
                if self._wants[i]:
                    self._logits[self._row_of[i]] = logits[b, t_n - k + t - skipped]

    def _tail(self, entries: list[int]) -> int:
        """How many of a slot's entries, counted from its last, span those asking for rows."""
        wanted = np.flatnonzero(self._wants[entries])
        return len(entries) - int(wanted[0]) if wanted.size else 0

    def _reserve(self, slot: int, cells: int) -> np.ndarray[Any, Any]:
        """``slot``'s KV arrays, holding at least ``cells`` cells (doubled as it fills)."""
        kv = self._kv[slot]
        if kv is None or kv.shape[2] < cells:
            shape = self.shape
            room = max(cells, _MIN_CELLS, 0 if kv is None else 2 * kv.shape[2])
            grown = np.empty(
                (2 * shape.n_layer, shape.n_kv_heads, min(room, self.n_ctx), shape.head_dim),
                shape.kv_dtype,
            )
            held = self._cells[slot]
            if kv is not None and held:
                grown[:, :, :held] = kv[:, :, :held]
            self._kv[slot] = kv = grown
        return kv

    def row(self, index: int) -> np.ndarray[Any, Any]:
        """The logits batch entry ``index`` asked for (the last decode's). # [V]"""
        r = int(self._row_of[index])
        if r < 0:
            raise IndexError(f"batch entry {index} asked for no logits")
        return self._logits[r]  # type: ignore[no-any-return]

    def rows(self, n: int) -> Rows:
        """The last decode's ``n`` rows of logits, in batch order. # [n, V]"""
        return self._logits[:n], 0

    def row_in(self, rows: Rows, index: int) -> np.ndarray[Any, Any]:
        """Entry ``index``'s row within :meth:`rows`' view (writable: nothing else reads it
        before the next decode). # [V]"""
        return rows[0][self._row_of[index]]  # type: ignore[no-any-return]

    def sample(self, chain: SamplerChain, index: int) -> int:
        """``chain``'s token from entry ``index``'s row, handed to llama.cpp's samplers."""
        return chain.draw(self.row(index))

    # -- KV cells ---------------------------------------------------------------

    def keep_prefix(self, slot: int, keep: int) -> bool:
        """Drop ``slot``'s cells from position ``keep`` on (the arrays stay allocated)."""
        self._cells[slot] = min(self._cells[slot], max(keep, 0))
        return True

    def clear(self, slot: int) -> None:
        """Drop ``slot``'s cells and free its arrays."""
        self._cells[slot] = 0
        self._kv[slot] = None


def _calls(groups: list[tuple[int, list[int]]], n: int) -> list[list[tuple[int, list[int]]]]:
    """The session runs of one step: every slot in one, unless single tokens share the step
    with a prompt slice so long that padding would more than double the rows computed;
    then the single tokens run by themselves."""
    longest = max(len(entries) for _, entries in groups)
    if len(groups) * longest <= 2 * n:
        return [groups]
    singles = [g for g in groups if len(g[1]) == 1]
    others = [g for g in groups if len(g[1]) > 1]
    return [calls for calls in (singles, others) if calls]


def _load(
    path: str, n_threads: int, gpu: bool, quiet: bool, data: str | None = None
) -> tuple[int, Any]:
    """The model's size (``model.onnx``'s, and ``data``'s where given) and its session,
    of the files ``path`` and ``data`` open (the gateway's verified descriptors, or
    paths): ONNX Runtime reads them through ``/proc/self/fd`` (module docstring)."""
    fds: list[int] = []
    try:
        size = _open(path, MODEL_FILE, fds)
        graph = f"/proc/self/fd/{fds[0]}"
        if data is None:
            session = _session(graph, n_threads, gpu, quiet)
        else:
            data_size = _open(data, "the data file", fds)
            name = _data_name(fds[0], size, data_size)
            weights = _mapped(fds[1], data_size)
            try:
                session = _session(graph, n_threads, gpu, quiet, (name, weights))
            finally:
                _unmap(weights)
            size += data_size
    finally:
        for fd in fds:  # the session holds the weights; the files are no longer read
            os.close(fd)
    _release_freed_heap()
    return size, session


def _open(path: str, what: str, fds: list[int]) -> int:
    """Open ``path`` (a regular file) into ``fds``; its size. :class:`LoadError` in words."""
    try:
        fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        raise LoadError(f"{what} cannot be read ({exc.strerror})") from exc
    info = os.fstat(fds[-1])
    if not stat.S_ISREG(info.st_mode):
        raise LoadError(f"{what} cannot be read (not a regular file)")
    return info.st_size


def _data_name(fd: int, size: int, data_size: int) -> str:
    """The name the graph open as ``fd`` gives its external data file (bounded reads of
    its protobuf, no weights), checked against a data file of ``data_size`` bytes."""
    # imported here: the registry package would add ~20 MiB to every ONNX worker
    from quantroute.registry.onnx_check import external_location

    try:
        with open(fd, "rb", closefd=False) as fh:
            name = external_location(fh, size, data_size)
    except ArtifactIntegrityError as exc:
        raise LoadError(f"model.onnx with its data file cannot be served: {exc.message}") from None
    except OSError as exc:
        raise LoadError(f"model.onnx cannot be read ({exc.strerror})") from exc
    if name is None:
        raise LoadError("a data file was given, and model.onnx keeps no tensor in another file")
    return name


def _mapped(fd: int, size: int) -> mmap.mmap:
    """The data file open as ``fd``, mapped read-only (its own pages: no copy)."""
    if size == 0:
        raise LoadError("the data file is empty")
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        raise LoadError(f"the data file cannot be mapped ({exc})") from exc


def _unmap(weights: mmap.mmap) -> None:
    """Unmap ``weights`` (ONNX Runtime copied what it needs); one still exported to a
    buffer that has not been let go of is left to the collector."""
    try:
        weights.close()
    except BufferError:
        log.debug("the data file's mapping is still referenced: unmapped when collected")


def _release_freed_heap() -> None:
    """Hand the heap the load freed back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): the parsed protobuf and the initializers' first copies, which glibc would
    otherwise keep resident for the arena's later growth."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _session(
    path: str, n_threads: int, gpu: bool, quiet: bool, data: tuple[str, mmap.mmap] | None = None
) -> Any:
    """An ONNX Runtime session of the ONNX graph at ``path``, run by ``n_threads`` threads;
    ``data``: its external data file's contents, under the name the graph gives it."""
    options = ort.SessionOptions()
    if data is not None:
        name, weights = data
        view = memoryview(weights)
        try:
            options.add_external_initializers_from_files_in_memory([name], [view], [len(view)])
        finally:
            view.release()
    options.add_session_config_entry("session.load_model_format", "ONNX")
    options.intra_op_num_threads = n_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = _ORT_ERRORS_ONLY if quiet else 2
    providers = ["CPUExecutionProvider"]
    if gpu:
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        else:
            log.warning("a GPU was asked for, but this onnxruntime has no CUDA provider: CPU")
    try:
        return ort.InferenceSession(path, options, providers=providers)
    except Exception as exc:  # ONNX Runtime's errors share no base but Exception
        raise LoadError(f"onnxruntime could not load model.onnx: {exc}") from exc

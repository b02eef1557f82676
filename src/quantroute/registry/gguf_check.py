"""A bounded check of a GGUF file's header, before anything trusts it.

:func:`check_gguf` reads the header with plain bounded reads — never a
memory map, never an allocation sized by the file — and refuses, with a
reason in words, a file that is not GGUF, has an unknown version, absurd
counts (tensors, metadata keys, array lengths), over-long strings, an
unknown tensor type, or a tensor whose data lies past the end of the file.
Whatever a hostile file says, the check reads at most the header's bytes and
keeps at most a few small numbers per tensor, so it can't exhaust memory or
time. Only a file that passes is handed to llama.cpp.

The same pass keeps the few metadata values the gateway needs
(:data:`WANTED_KEYS`, :data:`WANTED_SUFFIXES`: the architecture, layer and
head counts, widths, context length, the vocabulary's size, the chat
template): scalars, strings capped in bytes (:data:`MAX_KEPT_STRING`), an
array's length (``key#count``) and, for a short numeric array (per-layer
counts), its largest element. An array is never turned into a Python object
per element: fixed-size items are skipped in one seek, strings one length at
a time. :func:`read_gguf_isolated` returns them from the child below, so the
gateway's memory model (``telemetry.memory``) reads no model file itself.

:func:`check_gguf_isolated` runs the same check in a child process bounded in
time (a wall clock and ``RLIMIT_CPU``) and memory (``RLIMIT_AS``), so that even
a bug of ours, or of a library, on a hostile file costs a child, never the
gateway. ``python -m quantroute.registry.gguf_child FILE...`` is that child.

>>> import io
>>> check_gguf_stream(io.BytesIO(b"GGML"), 4)
Traceback (most recent call last):
...
quantroute.errors.ArtifactIntegrityError: not a GGUF file (bad magic)
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from quantroute.engines.environment import worker_env
from quantroute.errors import ArtifactIntegrityError

__all__ = [
    "WANTED_KEYS",
    "WANTED_SUFFIXES",
    "GgufSummary",
    "MetadataValue",
    "check_gguf",
    "check_gguf_isolated",
    "check_gguf_stream",
    "read_gguf_isolated",
    "summary_json",
]

MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_ARRAY = 1 << 24  # elements of one metadata array (vocabularies, merges)
MAX_STRING = 1 << 24  # bytes of one string (chat templates are kilobytes)
MAX_DIMS = 8
MAX_HEADER_BYTES = 1 << 30  # a header (metadata + tensor table) larger than this is refused
CHILD_TIMEOUT_S = 30.0  # wall clock of one isolated check (all its files)
CHILD_MEMORY_BYTES = 1 << 30  # address space of the checking child

#: Metadata kept whole: ``general.architecture`` and the tokenizer's (an ONNX branch's
#: tokenizer file must have a vocabulary: ``registry.onnx_check.check_vocabulary``).
WANTED_KEYS = frozenset(
    {
        "general.architecture",
        "tokenizer.chat_template",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
    }
)
#: Metadata kept under any prefix (the architecture's, ``llama.block_count``).
WANTED_SUFFIXES = (
    ".block_count",
    ".embedding_length",
    ".attention.head_count",
    ".attention.head_count_kv",
    ".attention.key_length",
    ".attention.value_length",
    ".context_length",
    ".feed_forward_length",
    ".vocab_size",
)
MAX_KEPT = 64  # metadata values kept at most
MAX_KEPT_KEY = 128  # bytes of a kept key
MAX_KEPT_STRING = 1 << 20  # bytes of a kept string (the chat template); a longer one is cut
MAX_KEPT_ARRAY = 4096  # elements of a numeric array whose largest element is kept

MetadataValue = int | float | bool | str

# GGUF value types: fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_FORMATS[12] = "d"
_STRING, _ARRAY = 8, 9
_UINT32 = 4


def _type_sizes() -> dict[int, tuple[int, int]]:
    """ggml tensor type → (elements per block, bytes per block), from the gguf package."""
    import gguf

    return {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True, slots=True)
class GgufSummary:
    version: int
    n_tensors: int
    n_kv: int
    data_offset: int
    data_bytes: int  # bytes the tensors need, from the data offset on
    weights_bytes: int = 0  # the tensors' sizes together
    #: the wanted metadata (see the module docstring); empty unless asked for
    metadata: dict[str, MetadataValue] = field(default_factory=dict)


_LENGTH = struct.Struct("<Q")
_CHUNK = 1 << 16


class _Reader:
    def __init__(self, stream: BinaryIO, size: int):
        self._stream = stream
        self._size = size
        self._origin = stream.tell()
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > min(self._size, MAX_HEADER_BYTES):
            raise ArtifactIntegrityError("GGUF header runs past the end of the file")
        data = self._stream.read(n)
        if len(data) != n:
            raise ArtifactIntegrityError("GGUF header runs past the end of the file")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > min(self._size, MAX_HEADER_BYTES):
            raise ArtifactIntegrityError("GGUF header runs past the end of the file")
        self._stream.seek(n, 1)
        self.pos += n

    def skip_strings(self, count: int) -> None:
        """Skip an array of ``count`` strings, reading their lengths a chunk at a time
        (a million empty strings: a second's loop, not a million reads)."""
        end = min(self._size, MAX_HEADER_BYTES)
        pos, buf, start = self.pos, b"", self.pos
        unpack = _LENGTH.unpack_from
        for _ in range(count):
            at = pos - start
            if at + 8 > len(buf):
                if pos + 8 > end:
                    raise ArtifactIntegrityError("GGUF header runs past the end of the file")
                self._stream.seek(self._origin + pos)
                buf, start, at = self._stream.read(min(_CHUNK, end - pos)), pos, 0
                if len(buf) < 8:
                    raise ArtifactIntegrityError("GGUF header runs past the end of the file")
            (n,) = unpack(buf, at)
            if n > MAX_STRING:
                raise ArtifactIntegrityError(
                    f"GGUF metadata string is {n} bytes long (at most {MAX_STRING})"
                )
            pos += 8 + n
            if pos > end:
                raise ArtifactIntegrityError("GGUF header runs past the end of the file")
        self._stream.seek(self._origin + pos)
        self.pos = pos

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self, what: str) -> bytes:
        n = self.u64()
        if n > MAX_STRING:
            raise ArtifactIntegrityError(f"GGUF {what} is {n} bytes long (at most {MAX_STRING})")
        return self.take(n)

    def skip_string(self, what: str) -> None:
        n = self.u64()
        if n > MAX_STRING:
            raise ArtifactIntegrityError(f"GGUF {what} is {n} bytes long (at most {MAX_STRING})")
        self.skip(n)


def check_gguf(path: Path, *, metadata: bool = False) -> GgufSummary:
    """Check ``path`` (see the module docstring), keeping the wanted metadata if
    ``metadata``; raises :class:`ArtifactIntegrityError`."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            return check_gguf_stream(fh, size, metadata=metadata)
    except OSError as exc:
        raise ArtifactIntegrityError(f"cannot read {path.name}: {exc.strerror}") from exc


def _wanted(key: bytes) -> str | None:
    if len(key) > MAX_KEPT_KEY:
        return None
    name = key.decode("utf-8", "replace")
    return name if name in WANTED_KEYS or name.endswith(WANTED_SUFFIXES) else None


def check_gguf_stream(stream: BinaryIO, size: int, *, metadata: bool = False) -> GgufSummary:
    """:func:`check_gguf` of an open file of ``size`` bytes."""
    r = _Reader(stream, size)
    kept: dict[str, MetadataValue] = {}
    if size < 4 or r.take(4) != b"GGUF":
        raise ArtifactIntegrityError("not a GGUF file (bad magic)")
    version = r.u32()
    if version not in (2, 3):
        raise ArtifactIntegrityError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > MAX_TENSORS:
        raise ArtifactIntegrityError(f"GGUF header declares {n_tensors} tensors (absurd)")
    if n_kv > MAX_KV:
        raise ArtifactIntegrityError(f"GGUF header declares {n_kv} metadata keys (absurd)")
    alignment = 32
    for _ in range(n_kv):
        key = r.string("metadata key")
        kind = r.u32()
        if key == b"general.alignment" and kind == _UINT32:
            alignment = r.u32()
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 16:
                raise ArtifactIntegrityError(f"GGUF alignment {alignment} is not a power of two")
            continue
        name = _wanted(key) if metadata and len(kept) < MAX_KEPT else None
        if name is None:
            _skip_value(r, kind, depth=0)
        else:
            _keep_value(r, kind, name, kept)
    sizes = _type_sizes()
    data_bytes = 0
    extents: list[tuple[int, int]] = []
    for _ in range(n_tensors):
        r.skip_string("tensor name")
        n_dims = r.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise ArtifactIntegrityError(f"GGUF tensor with {n_dims} dimensions")
        elements = 1
        for _ in range(n_dims):
            dim = r.u64()
            elements *= dim
            if elements > 1 << 48:
                raise ArtifactIntegrityError("GGUF tensor with an absurd number of elements")
        kind = r.u32()
        if kind not in sizes:
            raise ArtifactIntegrityError(f"GGUF tensor of unknown type {kind}")
        block, block_bytes = sizes[kind]
        if elements % block:
            raise ArtifactIntegrityError("GGUF tensor size is not a whole number of blocks")
        offset = r.u64()
        nbytes = elements // block * block_bytes
        extents.append((offset, nbytes))
    data_offset = -(-r.pos // alignment) * alignment
    room = size - data_offset
    for offset, nbytes in extents:
        if offset % alignment:
            raise ArtifactIntegrityError(
                f"a tensor's data offset {offset} is not a multiple of the alignment {alignment}"
            )
        if offset + nbytes > room:
            raise ArtifactIntegrityError(
                f"a tensor lies past the end of the file ({offset + nbytes} bytes of data "
                f"needed, {max(room, 0)} there): the file is truncated or corrupt"
            )
        data_bytes = max(data_bytes, offset + nbytes)
    weights = sum(nbytes for _, nbytes in extents)
    return GgufSummary(version, n_tensors, n_kv, data_offset, data_bytes, weights, kept)


def _skip_value(r: _Reader, kind: int, depth: int) -> None:
    if kind in _FIXED:
        r.skip(_FIXED[kind])
    elif kind == _STRING:
        r.skip_string("metadata string")
    elif kind == _ARRAY and depth == 0:
        item, count = r.u32(), r.u64()
        if count > MAX_ARRAY:
            raise ArtifactIntegrityError(f"GGUF metadata array of {count} items (absurd)")
        if item in _FIXED:
            r.skip(_FIXED[item] * count)
        elif item == _STRING:
            r.skip_strings(count)
        else:
            for _ in range(count):
                _skip_value(r, item, depth + 1)
    else:
        raise ArtifactIntegrityError(f"GGUF metadata value of unknown type {kind}")


def _keep_value(r: _Reader, kind: int, name: str, kept: dict[str, MetadataValue]) -> None:
    """Read a wanted value into ``kept``: a scalar, a string (its first
    :data:`MAX_KEPT_STRING` bytes), an array's length and, for a short numeric one,
    its largest element."""
    if kind in _FORMATS:
        (kept[name],) = struct.unpack("<" + _FORMATS[kind], r.take(_FIXED[kind]))
    elif kind == _STRING:
        n = r.u64()
        if n > MAX_STRING:
            raise ArtifactIntegrityError(f"GGUF metadata string is {n} bytes long (absurd)")
        kept[name] = r.take(min(n, MAX_KEPT_STRING)).decode("utf-8", "replace")
        r.skip(n - min(n, MAX_KEPT_STRING))
    elif kind == _ARRAY:
        item, count = r.u32(), r.u64()
        if count > MAX_ARRAY:
            raise ArtifactIntegrityError(f"GGUF metadata array of {count} items (absurd)")
        kept[name + "#count"] = count
        if item in _FORMATS and 0 < count <= MAX_KEPT_ARRAY and item != 7:
            data = r.take(_FIXED[item] * count)
            kept[name] = max(v for (v,) in struct.iter_unpack("<" + _FORMATS[item], data))
        elif item in _FIXED:
            r.skip(_FIXED[item] * count)
        elif item == _STRING:
            r.skip_strings(count)
        else:
            for _ in range(count):
                _skip_value(r, item, depth=1)
    else:
        raise ArtifactIntegrityError(f"GGUF metadata value of unknown type {kind}")


def check_gguf_isolated(
    paths: list[Path],
    *,
    timeout_s: float = CHILD_TIMEOUT_S,
    memory_bytes: int = CHILD_MEMORY_BYTES,
) -> list[str | None]:
    """:func:`check_gguf` of each path in one child process bounded in time and memory:
    per path, ``None`` (sound) or the reason it is refused. A child that runs out of
    time or memory, or dies, is tried again with each path alone, so that only the file
    that did it is refused (with that reason). The wanted metadata of each sound file is
    kept (while the file's size, mtime and ctime are the ones checked) for
    :func:`read_gguf_isolated`. Blocking: call it off the event loop."""
    found = _run_child(paths, timeout_s, memory_bytes)
    if len(paths) > 1 and all(isinstance(f, str) and f.startswith(_CHILD_FAILED) for f in found):
        found = [alone for path in paths for alone in _run_child([path], timeout_s, memory_bytes)]
    return [f if isinstance(f, str) else None for f in found]


def read_gguf_isolated(
    path: Path,
    *,
    timeout_s: float = CHILD_TIMEOUT_S,
    memory_bytes: int = CHILD_MEMORY_BYTES,
) -> GgufSummary:
    """:func:`check_gguf` of ``path`` with its wanted metadata: what the last isolated
    check of the same file found, or a new check in a child process bounded in time and
    memory (the gateway never parses a model file's metadata itself). Raises
    :class:`ArtifactIntegrityError` with the reason a file is refused. Blocking: call it
    off the event loop."""
    key = _stat_key(path)
    if key is not None:
        with _SUMMARIES_LOCK:
            summary = _SUMMARIES.get(key)
        if summary is not None:
            return summary
    (found,) = _run_child([path], timeout_s, memory_bytes)
    if isinstance(found, str):
        raise ArtifactIntegrityError(found)
    return found


_CHILD_FAILED = "the GGUF check "  # how a whole child's failure begins
_StatKey = tuple[str, int, int, int, int, int]
_SUMMARIES: dict[_StatKey, GgufSummary] = {}  # the latest isolated checks' results
_SUMMARIES_MAX = 256
_SUMMARIES_LOCK = threading.Lock()


def _stat_key(path: Path) -> _StatKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _run_child(paths: list[Path], timeout_s: float, memory_bytes: int) -> list[GgufSummary | str]:
    """Per path, its summary or the reason it is refused; summaries of files that did
    not change meanwhile are remembered."""
    if not paths:
        return []
    before = [_stat_key(p) for p in paths]
    argv = [sys.executable, "-m", "quantroute.registry.gguf_child", "--memory-bytes"]
    argv += [str(memory_bytes), *(str(p) for p in paths)]
    # the workers' allowlisted environment: no key of the gateway's reaches a hostile file
    env = worker_env(os.environ) | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return [f"{_CHILD_FAILED}took over {timeout_s:g} s (refused)"] * len(paths)
    try:
        answers = json.loads(done.stdout)
    except ValueError:
        answers = None
    if done.returncode != 0 or not isinstance(answers, list) or len(answers) != len(paths):
        code = done.returncode
        why = f"exit status {code}" if code >= 0 else f"signal {-code}"
        return [f"{_CHILD_FAILED}failed ({why}; over its memory limit?)"] * len(paths)
    found: list[GgufSummary | str] = []
    for path, key, answer in zip(paths, before, answers, strict=True):
        if isinstance(answer, dict):
            summary = _summary_from_json(answer)
            found.append(summary)
            if isinstance(summary, GgufSummary) and key is not None and _stat_key(path) == key:
                with _SUMMARIES_LOCK:
                    if len(_SUMMARIES) >= _SUMMARIES_MAX:
                        _SUMMARIES.pop(next(iter(_SUMMARIES)))
                    _SUMMARIES[key] = summary
        else:
            found.append(str(answer))
    return found


def summary_json(summary: GgufSummary) -> dict[str, Any]:
    """``summary`` as JSON (what the child writes)."""
    return asdict(summary)


def _summary_from_json(found: dict[str, Any]) -> GgufSummary | str:
    kept = found.get("metadata")
    metadata = {
        str(k): v
        for k, v in (kept.items() if isinstance(kept, dict) else ())
        if isinstance(v, int | float | bool | str)
    }
    try:
        return GgufSummary(
            int(found["version"]),
            int(found["n_tensors"]),
            int(found["n_kv"]),
            int(found["data_offset"]),
            int(found["data_bytes"]),
            int(found["weights_bytes"]),
            metadata,
        )
    except (KeyError, TypeError, ValueError):
        return "the GGUF check failed (a malformed answer)"

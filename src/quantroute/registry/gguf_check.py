"""A bounded check of a GGUF file's header, before anything trusts it.

:func:`check_gguf` reads the header with plain bounded reads — never a
memory map, never an allocation sized by the file — and refuses, with a
reason in words, a file that is not GGUF, has an unknown version, absurd
counts (tensors, metadata keys, array lengths), over-long strings, an
unknown tensor type, or a tensor whose data lies past the end of the file.
Whatever a hostile file says, the check reads at most the header's bytes and
keeps at most a few small numbers per tensor, so it can't exhaust memory or
time. Only a file that passes is handed to ``gguf.GGUFReader`` (the memory
model) or to llama.cpp.

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
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from quantroute.errors import ArtifactIntegrityError

__all__ = ["GgufSummary", "check_gguf", "check_gguf_isolated", "check_gguf_stream"]

MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_ARRAY = 1 << 24  # elements of one metadata array (vocabularies, merges)
MAX_STRING = 1 << 24  # bytes of one string (chat templates are kilobytes)
MAX_DIMS = 8
MAX_HEADER_BYTES = 1 << 30  # a header (metadata + tensor table) larger than this is refused
CHILD_TIMEOUT_S = 30.0  # wall clock of one isolated check (all its files)
CHILD_MEMORY_BYTES = 1 << 30  # address space of the checking child

# GGUF value types: fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
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


class _Reader:
    def __init__(self, stream: BinaryIO, size: int):
        self._stream = stream
        self._size = size
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


def check_gguf(path: Path) -> GgufSummary:
    """Check ``path`` (see the module docstring); raises :class:`ArtifactIntegrityError`."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            return check_gguf_stream(fh, size)
    except OSError as exc:
        raise ArtifactIntegrityError(f"cannot read {path.name}: {exc.strerror}") from exc


def check_gguf_stream(stream: BinaryIO, size: int) -> GgufSummary:
    r = _Reader(stream, size)
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
        _skip_value(r, kind, depth=0)
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
    return GgufSummary(version, n_tensors, n_kv, data_offset, data_bytes)


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
        else:
            for _ in range(count):
                _skip_value(r, item, depth + 1)
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
    time or memory, or dies, refuses every path with that reason. Blocking: call it
    off the event loop."""
    if not paths:
        return []
    argv = [sys.executable, "-m", "quantroute.registry.gguf_child", "--memory-bytes"]
    argv += [str(memory_bytes), *(str(p) for p in paths)]
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return [f"the GGUF check took over {timeout_s:g} s (refused)"] * len(paths)
    try:
        found = json.loads(done.stdout)
        if done.returncode == 0 and isinstance(found, list) and len(found) == len(paths):
            return [None if f is None else str(f) for f in found]
    except ValueError:
        pass
    why = f"exit status {done.returncode}" if done.returncode >= 0 else f"signal {-done.returncode}"
    return [f"the GGUF check failed ({why}; over its memory limit?)"] * len(paths)

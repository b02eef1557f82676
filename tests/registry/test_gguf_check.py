"""The bounded GGUF header check: real files pass; truncated, corrupt and hostile ones are
refused in words, reading no more than the header, whatever the header claims."""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from qrtest import demo_model_dir
from quantroute.errors import ArtifactIntegrityError
from quantroute.registry.gguf_check import check_gguf, check_gguf_stream


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_k_m"])
def test_the_demo_files_pass(name: str) -> None:
    path = demo_model_dir() / f"{name}.gguf"
    summary = check_gguf(path)
    assert summary.n_tensors > 0 and summary.n_kv > 0
    assert summary.data_offset + summary.data_bytes <= path.stat().st_size


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    data = (demo_model_dir() / "q8_0.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactIntegrityError, match="past the end of the file"):
        check_gguf(cut)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"GGML" + b"\0" * 60, "bad magic"),
        (b"", "bad magic"),
        (_header(0, 0, version=9), "version 9"),
        (_header(1 << 40, 0), r"tensors \(absurd\)"),
        (_header(0, 1 << 40), r"metadata keys \(absurd\)"),
        # a key whose string claims 2**62 bytes
        (_header(0, 1) + struct.pack("<Q", 1 << 62), "bytes long"),
        # an array claiming 2**40 strings
        (_header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 1 << 40), "absurd"),
        # a value of an unknown type
        (_header(0, 1) + _string(b"k") + struct.pack("<I", 77), "unknown type 77"),
        # a tensor of an unknown ggml type
        (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 32, 999, 0), "unknown type"),
        # a tensor of absurd size
        (_header(1, 0) + _string(b"t") + struct.pack("<IQQ", 2, 1 << 40, 1 << 40), "absurd"),
        # a tensor whose data is past the end
        (_header(1, 0) + _string(b"t") + struct.pack("<IQIQ", 1, 1024, 0, 0), "past the end"),
        # the header itself ends early
        (_header(2, 0) + _string(b"t"), "past the end"),
    ],
)
def test_corrupt_and_hostile_headers_are_refused_in_words(data: bytes, words: str) -> None:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ArtifactIntegrityError, match=words):
            check_gguf_stream(io.BytesIO(data), len(data))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # whatever the header claims, nothing large is allocated
    assert time.perf_counter() - started < 1.0

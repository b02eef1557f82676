"""A fuzzer over the parsers of model files (issue 32, section 5): the bounded GGUF
header check and the manifest's YAML loading and validation.

Every input — the packaged demo's real GGUF header, mutated (bytes flipped, counts
and lengths set to extremes, cut short, spliced), random bytes, and manifests
built from the demo's — must finish within :data:`BUDGET_S`, allocate at most
:data:`BUDGET_BYTES` beyond its own size (tracemalloc), and raise nothing but the
parser's own error. Seeded (``derandomize``), so CI sees the same examples.
"""

from __future__ import annotations

import contextlib
import io
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qrtest import demo_model_dir
from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry.gguf_check import check_gguf, check_gguf_stream
from quantroute.registry.manifest import parse_manifest

BUDGET_S = 1.0
BUDGET_BYTES = 4 << 20
FUZZ = settings(
    max_examples=150,
    deadline=None,  # our own clock below, with tracemalloc's cost in it
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_DEMO = demo_model_dir() / "q4_k_m.gguf"
HEADER = _DEMO.read_bytes()[: check_gguf(_DEMO).data_offset]  # 10 KiB: metadata, tensors
FILE_SIZE = _DEMO.stat().st_size
EXTREMES = [0, 1, 7, 8, 255, 1 << 16, 1 << 24, (1 << 24) + 1, 1 << 31, (1 << 32) - 1, 1 << 62]
EXTREMES += [(1 << 64) - 1]


def _bounded(call: Callable[[], Any], errors: type[Exception], extra: int = 0) -> None:
    """``call()`` returns or raises ``errors``, within the time budget (timed alone:
    tracemalloc slows allocation-heavy code tenfold) and the memory budget."""
    start = time.monotonic()
    with contextlib.suppress(errors):
        call()
    assert time.monotonic() - start < BUDGET_S
    tracemalloc.start()
    try:
        with contextlib.suppress(errors):
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BUDGET_BYTES + extra


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    data = bytearray(HEADER)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["byte", "u32", "u64", "cut", "splice", "delete"]))
        at = draw(st.integers(0, len(data) - 1)) if data else 0
        if kind == "byte" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind in ("u32", "u64"):
            width, fmt = (4, "<I") if kind == "u32" else (8, "<Q")
            value = draw(st.sampled_from(EXTREMES)) % (1 << (8 * width))
            data[at : at + width] = struct.pack(fmt, value)
        elif kind == "cut":
            del data[at:]
        elif kind == "splice":
            data[at:at] = draw(st.binary(max_size=64))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


@FUZZ
@given(mutated_headers(), st.booleans(), st.booleans())
@example(HEADER, True, True)
@example(HEADER[:24] + struct.pack("<Q", (1 << 64) - 1) + HEADER[32:], True, False)
def test_gguf_check_of_a_mutated_real_header(data: bytes, whole: bool, metadata: bool) -> None:
    size = FILE_SIZE if whole else len(data)  # as if the tensors' data followed, or not
    _bounded(
        lambda: check_gguf_stream(io.BytesIO(data), size, metadata=metadata),
        ArtifactIntegrityError,
        extra=len(data),
    )


@FUZZ
@given(st.binary(max_size=4096), st.booleans())
def test_gguf_check_of_random_bytes(data: bytes, magic: bool) -> None:
    if magic:
        data = b"GGUF\x03\x00\x00\x00" + data
    _bounded(
        lambda: check_gguf_stream(io.BytesIO(data), len(data), metadata=True),
        ArtifactIntegrityError,
        extra=len(data),
    )


# ---- the manifest -------------------------------------------------------------------------------

MANIFEST = (demo_model_dir() / "quantroute.yaml").read_bytes()
YAML_BITS = [
    b"[", b"]", b"{", b"}", b": ", b"- ", b"\n", b"  ", b"&a ", b"*a", b"!!binary ", b"!!str ",
    b"'", b'"', b"#", b"---\n", b"...\n", b"2001-02-30", b"1e999", b"9" * 5000, b"null", b"~",
    b"? ", b"|", b">", b"%YAML 1.1\n", b"\xff", b"\t", b"<<: ",
]  # fmt: skip


@st.composite
def mutated_manifests(draw: st.DrawFn) -> bytes:
    data = bytearray(MANIFEST)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            data[at:at] = draw(st.sampled_from(YAML_BITS)) * draw(st.integers(1, 4))
        else:
            del data[at : at + draw(st.integers(1, 32))]
    return bytes(data)


# What escaped parse_manifest before issue 32 (ValueError, RecursionError after seconds
# of PyYAML's scanner), and the block-style nesting that does not.
KNOWN = {
    "no such date": b"model: 2001-02-30\n",
    "a 5000-digit integer": b"model: x\nreference: " + b"9" * 5000 + b"\n",
    "deep flow nesting": b"[" * 100_000,
    "deep block sequence": b"- " * 2000 + b"x",
    "deep block mapping": b"".join(b" " * i + b"a:\n" for i in range(300)),  # 45 KiB
}


@pytest.mark.parametrize("data", KNOWN.values(), ids=KNOWN.keys())
def test_manifest_parser_known_escapes(data: bytes) -> None:
    _bounded(lambda: parse_manifest(Path("m"), data), ManifestError, extra=len(data))


@FUZZ
@given(st.one_of(mutated_manifests(), st.binary(max_size=2048)))
def test_manifest_parser_of_mutated_and_random_input(data: bytes) -> None:
    _bounded(lambda: parse_manifest(Path("m"), data), ManifestError, extra=len(data))

"""Raw GGUF files for the security tests: a small sound model, plus metadata bombs.

Written byte by byte (struct), so a test can make a file no writer would: an array of
a million empty strings, 65536 keys, a 16 MiB string.
"""

from __future__ import annotations

import struct
from pathlib import Path

U32, F32, STRING, ARRAY, U8 = 4, 6, 8, 9, 0


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", U32, value)


def kv_str(key: str, value: str | bytes) -> bytes:
    return _s(key) + struct.pack("<I", STRING) + _s(value)


def kv_strings(key: str, count: int, item: bytes = b"") -> bytes:
    """An array of ``count`` copies of ``item`` (8 bytes each when empty)."""
    return _s(key) + struct.pack("<IIQ", ARRAY, STRING, count) + _s(item) * count


def kv_u8s(key: str, count: int) -> bytes:
    return _s(key) + struct.pack("<IIQ", ARRAY, U8, count) + b"\0" * count


MODEL = [
    kv_str("general.architecture", "llama"),
    kv_u32("llama.block_count", 2),
    kv_u32("llama.embedding_length", 64),
    kv_u32("llama.attention.head_count", 4),
    kv_u32("llama.context_length", 128),
    kv_u32("llama.feed_forward_length", 96),
]


def gguf_bytes(kvs: list[bytes], n_floats: int = 64) -> bytes:
    """A GGUF v3 file with ``kvs`` and one F32 tensor of ``n_floats`` elements."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kvs)) + b"".join(kvs)
    head += _s("t.weight") + struct.pack("<IQIQ", 1, n_floats, 0, 0)  # 1 dim, F32, offset 0
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * (4 * n_floats)


def write_gguf(path: Path, extra: list[bytes]) -> Path:
    path.write_bytes(gguf_bytes([*MODEL, *extra]))
    return path


BOMBS = {
    "a million empty strings": [kv_strings("tokenizer.ggml.tokens", 1_000_000)],
    "sixteen million bytes": [kv_u8s("llama.bomb", 1 << 24)],
    "65536 keys": [kv_u32(f"k{i}", i) for i in range(65536 - len(MODEL))],
    "a 16 MiB chat template": [kv_str("tokenizer.chat_template", b"x" * (1 << 24))],
}

"""The demo vocabulary: layout, round trip, and agreement with llama.cpp's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from quantroute.demo import DEFAULT_REPO_DIR, VOCAB
from quantroute.demo.data import list_sources, stdlib_root
from quantroute.demo.vocab import BOS_ID, BYTE_BASE, EOS_ID, SPACE_ID, UNK_ID

llama_cpp = pytest.importorskip("llama_cpp")

SAMPLES = [
    "",
    "def f(x):\n    return x + 1\n",
    "class A(object):\n\tpass\r\n",
    "  leading and trailing spaces  ",
    "caf\u00e9 \u2603 \U0001f600 \u4e2d\u6587",  # 2-, 3- and 4-byte UTF-8
    "<s> </s> <unk> <0x41> are plain text here",
    "tabs\tand\x00nul\x7fdel\x1bescape",
    "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
]


def test_layout_matches_the_documented_table() -> None:
    assert VOCAB.size == 354
    assert VOCAB.tokens[UNK_ID] == "<unk>"
    assert VOCAB.tokens[BOS_ID] == "<s>"
    assert VOCAB.tokens[EOS_ID] == "</s>"
    assert VOCAB.tokens[BYTE_BASE + 0x0A] == "<0x0A>"
    assert VOCAB.tokens[BYTE_BASE + 0xFF] == "<0xFF>"
    assert VOCAB.tokens[SPACE_ID] == "\u2581"
    assert VOCAB.token_types[BYTE_BASE : BYTE_BASE + 256] == (6,) * 256
    assert VOCAB.token_types[:3] == (2, 3, 3)
    assert len(set(VOCAB.tokens)) == VOCAB.size


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(text: str) -> None:
    ids = VOCAB.encode(text)
    assert ids[0] == BOS_ID
    assert VOCAB.decode(ids) == text


def test_printable_ascii_is_one_token_per_char_and_the_rest_is_bytes() -> None:
    ids = VOCAB.encode("a b\n\u00e9", add_bos=False, add_eos=True)
    a, z = VOCAB.tokens.index("a"), VOCAB.tokens.index("b")
    assert ids == [a, SPACE_ID, z, BYTE_BASE + 0x0A, BYTE_BASE + 0xC3, BYTE_BASE + 0xA9, EOS_ID]


def test_a_literal_space_piece_reads_as_a_space() -> None:
    assert VOCAB.encode("a\u2581b") == VOCAB.encode("a b")


@pytest.fixture(scope="module")
def shipped_tokenizer() -> Iterator[object]:
    path = DEFAULT_REPO_DIR / "f16.gguf"
    tok = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield tok
    tok.close()


def test_the_shipped_gguf_carries_this_vocabulary() -> None:
    reader = gguf.GGUFReader(DEFAULT_REPO_DIR / "f16.gguf")
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"
    assert tuple(reader.get_field("tokenizer.ggml.tokens").contents()) == VOCAB.tokens
    assert tuple(reader.get_field("tokenizer.ggml.token_type").contents()) == VOCAB.token_types
    assert reader.get_field("tokenizer.ggml.add_space_prefix").contents() is False


@pytest.mark.parametrize("text", [*SAMPLES, "\u2581x"])
def test_encode_agrees_with_llama_cpp(shipped_tokenizer: object, text: str) -> None:
    got = shipped_tokenizer.tokenize(text.encode(), add_bos=True, special=False)  # type: ignore[attr-defined]
    assert got == VOCAB.encode(text)


def test_encode_agrees_with_llama_cpp_on_stdlib_sources(shipped_tokenizer: object) -> None:
    paths = list_sources(stdlib_root())[:40:4]
    assert paths
    for path in paths:
        text = path.read_text(encoding="utf-8")[:4000]
        got = shipped_tokenizer.tokenize(text.encode(), add_bos=True)  # type: ignore[attr-defined]
        assert got == VOCAB.encode(text), Path(path).name
        back = shipped_tokenizer.detokenize(got).decode()  # type: ignore[attr-defined]
        assert back == VOCAB.decode(got) == text

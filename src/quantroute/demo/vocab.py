"""The demo model's byte-level vocabulary, a SentencePiece-style ``llama`` tokenizer.

Layout (354 tokens)::

    0          <unk>        UNKNOWN
    1          <s>          CONTROL  (BOS, added at the start of every sequence)
    2          </s>         CONTROL  (EOS, ends a document)
    3..258     <0x00>..<0xFF>  BYTE  (byte fallback)
    259        ▁            NORMAL   (the space)
    260..353   ! .. ~       NORMAL   (the other printable ASCII characters)

llama.cpp's SPM tokenizer, with ``add_space_prefix`` false, turns every space
into ``▁``, looks each UTF-8 character up as a whole token, and falls back to
one ``<0xNN>`` token per byte for characters the vocabulary lacks. There are no
multi-character tokens, so no merges ever apply: :func:`encode` reproduces
llama.cpp's token ids exactly, and fast (a table lookup over UTF-8 bytes).

>>> VOCAB.decode(VOCAB.encode("def f(x):\\n    return x"))
'def f(x):\\n    return x'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

SPACE_PIECE = "\u2581"  # "▁", SentencePiece's visible space

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_BASE = 3  # <0x00> is token 3, <0xFF> token 258
SPACE_ID = BYTE_BASE + 256
FIRST_CHAR_ID = SPACE_ID + 1
_PRINTABLE = range(0x21, 0x7F)  # "!" .. "~"

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_BYTE = 6


def _build_tables() -> tuple[tuple[str, ...], tuple[int, ...], npt.NDArray[np.int32]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]  # upper-case hex, as llama.cpp looks them up
    types += [TOKEN_TYPE_BYTE] * 256
    tokens.append(SPACE_PIECE)
    types.append(TOKEN_TYPE_NORMAL)
    tokens += [chr(c) for c in _PRINTABLE]
    types += [TOKEN_TYPE_NORMAL] * len(_PRINTABLE)

    byte_to_id = np.arange(BYTE_BASE, BYTE_BASE + 256, dtype=np.int32)  # [256]
    byte_to_id[0x20] = SPACE_ID
    for i, c in enumerate(_PRINTABLE):
        byte_to_id[c] = FIRST_CHAR_ID + i
    return tuple(tokens), tuple(types), byte_to_id


@dataclass(frozen=True, slots=True, repr=False)
class ByteVocab:
    """The token table plus encode/decode that agree with llama.cpp.

    Build it with :func:`ByteVocab.standard` (or use :data:`VOCAB`).
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    byte_to_id: npt.NDArray[np.int32] = field(repr=False, compare=False)
    # id -> the bytes it stands for (empty for control tokens)
    id_to_bytes: tuple[bytes, ...] = field(repr=False, compare=False)

    @classmethod
    def standard(cls) -> ByteVocab:
        """The 354-token vocabulary described in the module docstring."""
        tokens, types, byte_to_id = _build_tables()
        pieces: list[bytes] = []
        for token, kind in zip(tokens, types, strict=True):
            if kind == TOKEN_TYPE_BYTE:
                pieces.append(bytes([int(token[3:5], 16)]))
            elif kind == TOKEN_TYPE_NORMAL:
                pieces.append(token.replace(SPACE_PIECE, " ").encode())
            else:
                pieces.append(b"")
        return cls(tokens, types, byte_to_id, tuple(pieces))

    def __repr__(self) -> str:
        return f"ByteVocab(size={self.size})"

    @property
    def size(self) -> int:
        """Number of tokens (the model's ``n_vocab``)."""
        return len(self.tokens)

    @property
    def scores(self) -> tuple[float, ...]:
        """SentencePiece scores; all zero, since no merges exist to rank."""
        return (0.0,) * len(self.tokens)

    def encode_array(
        self, text: str, *, add_bos: bool = True, add_eos: bool = False
    ) -> npt.NDArray[np.int32]:
        """Token ids of ``text`` as an int32 array, exactly as llama.cpp tokenizes it.

        llama.cpp reads a literal ``▁`` in the text as the space token, so it is
        mapped to a space first; lone surrogates (not valid UTF-8) are dropped.
        """
        raw = text.replace(SPACE_PIECE, " ").encode("utf-8", errors="ignore")
        body = self.byte_to_id[np.frombuffer(raw, dtype=np.uint8)]  # [len(raw)]
        parts = [np.array([BOS_ID], dtype=np.int32)] if add_bos else []
        parts.append(body)
        if add_eos:
            parts.append(np.array([EOS_ID], dtype=np.int32))
        return np.concatenate(parts).astype(np.int32, copy=False)

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` as a list (see :meth:`encode_array`)."""
        ids: list[int] = self.encode_array(text, add_bos=add_bos, add_eos=add_eos).tolist()
        return ids

    def decode(self, ids: list[int] | npt.NDArray[np.integer]) -> str:
        """Text of ``ids``; control tokens vanish, invalid UTF-8 becomes U+FFFD."""
        out = b"".join(self.id_to_bytes[int(i)] for i in ids)
        return out.decode("utf-8", errors="replace")

    def add_to_gguf(self, writer: Any) -> None:
        """Write the ``tokenizer.*`` metadata llama.cpp's SPM tokenizer loads."""
        writer.add_vocab_size(self.size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(list(self.tokens))
        writer.add_token_scores(list(self.scores))
        writer.add_token_types(list(self.token_types))
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_unk_token_id(UNK_ID)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)


VOCAB = ByteVocab.standard()
"""The one vocabulary the demo model uses."""

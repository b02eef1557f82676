"""A byte-level BPE vocabulary (GPT-2 style), trained with ``tokenizers``, as llama.cpp reads it.

Layout (``BpeConfig.vocab_size`` tokens, 32,000 by default)::

    0          <|endoftext|>  CONTROL  (BOS, and the separator between documents)
    1          <|im_start|>   CONTROL  (opens a chat turn)
    2          <|im_end|>     CONTROL  (closes a chat turn; EOS)
    3..258     the 256 byte symbols     NORMAL  (GPT-2's byte-to-unicode alphabet)
    259..      merged tokens, in merge order    NORMAL

The pre-tokenizer is GPT-2's: the regex
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
over the raw text, no normalization, no prefix space. llama.cpp knows it as
``tokenizer.ggml.pre = "gpt-2"``, so its BPE tokenizer
(``tokenizer.ggml.model = "gpt2"``) gives the same ids as ``tokenizers`` for
any text: BPE applies merges by rank inside each pre-token, on both sides.

Special tokens are only special where the caller asks: :meth:`BpeVocab.encode`
with ``parse_special=False`` (the default, as llama.cpp's
``llama_tokenize(..., parse_special=false)``) reads ``<|im_start|>`` in the
text as plain characters.

>>> vocab = train_bpe([source_text], BpeConfig(vocab_size=400))  # doctest: +SKIP
>>> vocab.decode(vocab.encode("def f(x):\\n    return x"))  # doctest: +SKIP
'def f(x):\\n    return x'
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantroute.demo.vocab import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
"""The added special tokens, in id order (0, 1, 2)."""

PRE_TOKENIZER = "gpt-2"
"""llama.cpp's name (``tokenizer.ggml.pre``) for the pre-tokenizer trained here."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the chat template written to ``tokenizer.chat_template``."""


@dataclass(frozen=True, slots=True)
class BpeConfig:
    """How the vocabulary is trained. ``vocab_size`` counts the special tokens."""

    vocab_size: int = 32_000
    min_frequency: int = 2

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must hold the 256 byte symbols and the special tokens")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # the `train` extra
        raise RuntimeError("the BPE vocabulary needs the 'tokenizers' package") from exc
    return tokenizers


def train_bpe(
    texts: Iterable[str], config: BpeConfig | None = None, *, progress: bool = False
) -> BpeVocab:
    """Train a byte-level BPE vocabulary on ``texts`` (one document each).

    Deterministic: the same texts and config give the same merges. The result
    may have fewer than ``vocab_size`` tokens if the texts run out of pairs
    seen ``min_frequency`` times.
    """
    cfg = config or BpeConfig()
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocab = BpeVocab.from_tokenizer(tokenizer)
    logger.info("bpe: %d tokens, %d merges", vocab.size, len(vocab.merges))
    return vocab


@dataclass(frozen=True, slots=True, repr=False)
class BpeVocab:
    """A trained byte-level BPE vocabulary: the GGUF tables and a ``tokenizers`` encoder.

    Make one with :func:`train_bpe`, :meth:`from_file` (a ``tokenizer.json``) or
    :meth:`from_tokenizer`.
    """

    tokens: tuple[str, ...]  # byte-level unicode strings, "Ġ" for a space
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", highest priority first
    tokenizer_json: str = field(compare=False)
    _tokenizer: Tokenizer = field(compare=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> BpeVocab:
        """Read the tables out of a ``tokenizers.Tokenizer`` with a byte-level BPE model."""
        text = tokenizer.to_str()
        data = json.loads(text)
        model = data["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"not a BPE tokenizer: {model.get('type')!r}")
        by_id = sorted((i, t) for t, i in model["vocab"].items())
        tokens = tuple(t for _, t in by_id)
        if [i for i, _ in by_id] != list(range(len(tokens))):
            raise ValueError("token ids are not contiguous")
        if tokens[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(f"the first tokens must be {SPECIAL_TOKENS}")
        special = set(SPECIAL_TOKENS)
        types = tuple(TOKEN_TYPE_CONTROL if t in special else TOKEN_TYPE_NORMAL for t in tokens)
        # tokenizers writes merges as ["a", "b"] pairs (older versions: "a b" strings)
        merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
        return cls(tokens, types, merges, text, tokenizer)

    @classmethod
    def from_file(cls, path: Path) -> BpeVocab:
        """Load a ``tokenizer.json`` written by :meth:`save`."""
        tk = _tokenizers()
        return cls.from_tokenizer(tk.Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        """Write the ``tokenizers`` JSON (``tokenizer.json``)."""
        path.write_text(self.tokenizer_json, encoding="utf-8")

    def __repr__(self) -> str:
        return f"BpeVocab(size={self.size}, merges={len(self.merges)})"

    @property
    def size(self) -> int:
        """Number of tokens (the model's ``n_vocab``)."""
        return len(self.tokens)

    @property
    def bos_id(self) -> int:
        """``<|endoftext|>``: put in front of every sequence, and between documents."""
        return SPECIAL_TOKENS.index(ENDOFTEXT)

    @property
    def eos_id(self) -> int:
        """``<|im_end|>``, the end of a chat turn (llama.cpp also stops at ``<|endoftext|>``)."""
        return SPECIAL_TOKENS.index(IM_END)

    @property
    def im_start_id(self) -> int:
        """``<|im_start|>``."""
        return SPECIAL_TOKENS.index(IM_START)

    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        ``parse_special`` reads ``<|im_start|>`` and the other special tokens
        in the text as those tokens; otherwise they are plain characters.
        """
        return self.encode_batch([text], add_bos=add_bos, parse_special=parse_special)[0]

    def encode_batch(
        self, texts: Sequence[str], *, add_bos: bool = False, parse_special: bool = False
    ) -> list[list[int]]:
        """:meth:`encode` for many texts at once (in parallel, in ``tokenizers``).

        Not for concurrent use from several threads: it sets the tokenizer's
        ``encode_special_tokens`` for the call.
        """
        tok = self._tokenizer
        before = tok.encode_special_tokens
        tok.encode_special_tokens = not parse_special
        try:
            encodings = tok.encode_batch(list(texts), add_special_tokens=False)
        finally:
            tok.encode_special_tokens = before
        head = [self.bos_id] if add_bos else []
        return [head + list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens vanish, invalid UTF-8 becomes U+FFFD."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def add_to_gguf(self, writer: Any) -> None:
        """Write the ``tokenizer.*`` metadata llama.cpp's BPE tokenizer loads."""
        writer.add_vocab_size(self.size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(PRE_TOKENIZER)
        writer.add_token_list(list(self.tokens))
        writer.add_token_types(list(self.token_types))
        writer.add_token_merges(list(self.merges))
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        writer.add_eot_token_id(self.eos_id)
        writer.add_pad_token_id(self.bos_id)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHATML_TEMPLATE)

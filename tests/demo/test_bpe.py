"""The byte-level BPE vocabulary: layout, round trip, and agreement with llama.cpp.

A micro vocabulary (1,000 tokens, trained on 300 KB of the standard library in
well under a second) and a one-layer GQA model written with it as a GGUF stand
in for the realistic demo model, whose own checks are in test_realistic.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from quantroute.demo import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    BpeConfig,
    BpeVocab,
    ModelConfig,
    Source,
    chat_examples,
    chat_tokens,
    read_llama_gguf,
    read_metadata,
    select_sources,
    train_bpe,
    write_llama_gguf,
)
from quantroute.demo.vocab import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL
from quantroute.shaping.chat_template import render_chat

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")

SAMPLES = [
    "",
    "def f(x):\n    return x + 1\n",
    "class A(object):\n    pass\n\n\n\n        \n",
    "  leading and trailing spaces  ",
    "   \n\t\t  mixed\twhitespace \n \n",
    "caf\u00e9 \u2603 \U0001f600 \u4e2d\u6587 \u00a0nbsp \u3000ideographic \u2028sep",
    "it's they'll we're I'M you'D 123456789 3.14e-10 0x1F",
    "tabs\tand\x00nul\x7fdel\x1bescape\r\nwindows\rold mac",
    "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> <|im_end|>x<|im_start|",
    "<s> </s> <unk> <0x41> are plain text here",
]


@pytest.fixture(scope="module")
def sources() -> list[Source]:
    return select_sources(seed=0, max_bytes=300_000)


@pytest.fixture(scope="module")
def vocab(sources: list[Source]) -> BpeVocab:
    return train_bpe([s.text for s in sources], BpeConfig(vocab_size=1000))


def _texts(sources: list[Source]) -> list[str]:
    return SAMPLES + [s.text[:4000] for s in sources[:20]]


# --- the vocabulary itself ---------------------------------------------------------


def test_layout_is_specials_then_bytes_then_merges(vocab: BpeVocab) -> None:
    from tokenizers.pre_tokenizers import ByteLevel

    assert vocab.size == 1000
    assert vocab.tokens[:3] == SPECIAL_TOKENS == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert (vocab.bos_id, vocab.im_start_id, vocab.eos_id) == (0, 1, 2)
    assert vocab.token_types[:3] == (TOKEN_TYPE_CONTROL,) * 3
    assert set(vocab.token_types[3:]) == {TOKEN_TYPE_NORMAL}
    assert set(vocab.tokens[3:259]) == set(ByteLevel.alphabet())
    assert len(set(vocab.tokens)) == vocab.size
    assert len(vocab.merges) == vocab.size - 259
    # every merge joins two earlier tokens into the token of the same rank
    for rank, merge in enumerate(vocab.merges[:50]):
        left, right = merge.split(" ")
        assert vocab.tokens.index(left) < 259 + rank
        assert vocab.tokens[259 + rank] == left + right


def test_round_trip_is_exact(vocab: BpeVocab, sources: list[Source]) -> None:
    for text in _texts(sources):
        assert vocab.decode(vocab.encode(text)) == text


def test_merges_compress_python(vocab: BpeVocab, sources: list[Source]) -> None:
    text = sources[0].text
    assert len(vocab.encode(text)) < len(text.encode()) / 2


def test_special_tokens_are_special_only_when_parsed(vocab: BpeVocab) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = vocab.encode(text, parse_special=True)
    assert parsed[0] == vocab.im_start_id
    assert parsed[-1] == vocab.eos_id
    plain = vocab.encode(text)
    assert not set(plain) & {0, 1, 2}
    assert vocab.decode(plain) == text
    assert vocab.decode(parsed) == "user\nhi"  # special tokens vanish from text
    assert vocab.encode("x", add_bos=True) == [vocab.bos_id, *vocab.encode("x")]


def test_training_is_deterministic(vocab: BpeVocab, sources: list[Source]) -> None:
    again = train_bpe([s.text for s in sources], BpeConfig(vocab_size=1000))
    assert again.tokenizer_json == vocab.tokenizer_json
    assert again == vocab


def test_saved_tokenizer_loads_the_same(vocab: BpeVocab, tmp_path: Path) -> None:
    vocab.save(tmp_path / "tokenizer.json")
    loaded = BpeVocab.from_file(tmp_path / "tokenizer.json")
    assert loaded == vocab
    assert loaded.encode(SAMPLES[1]) == vocab.encode(SAMPLES[1])


def test_too_small_a_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="byte symbols"):
        BpeConfig(vocab_size=258)


# --- as llama.cpp reads it ------------------------------------------------------------

MICRO = ModelConfig(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=128, context_length=128)


@pytest.fixture(scope="module")
def micro_gguf(vocab: BpeVocab, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer GQA model with the micro vocabulary; weights random but peaky."""
    rng = np.random.default_rng(0)
    config = ModelConfig(**{**_fields(MICRO), "vocab_size": vocab.size})
    from quantroute.demo.model import param_shapes

    weights = {
        name: (rng.standard_normal(shape) * 0.3 + (1.0 if len(shape) == 1 else 0.0)).astype(
            np.float32
        )
        for name, shape in param_shapes(config).items()
    }
    path = tmp_path_factory.mktemp("bpe") / "micro.gguf"
    write_llama_gguf(path, weights, config, vocab=vocab, name="micro-bpe")
    return path


def _fields(config: ModelConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


@pytest.fixture(scope="module")
def llama_vocab(micro_gguf: Path, llama_vocab_of: Callable[[Path], Any]) -> Any:
    return llama_vocab_of(micro_gguf)


def test_llama_cpp_tokenizes_like_tokenizers(
    llama_vocab: Any, vocab: BpeVocab, sources: list[Source]
) -> None:
    for text in _texts(sources):
        for special in (False, True):
            assert llama_vocab.tokenize(text, special=special) == vocab.encode(
                text, parse_special=special
            ), (special, text[:60])
    # llama.cpp adds BOS (<|endoftext|>) and no EOS
    assert llama_vocab.tokenize("x = 1", add_special=True) == vocab.encode("x = 1", add_bos=True)


def test_llama_cpp_detokenizes_like_tokenizers(llama_vocab: Any, vocab: BpeVocab) -> None:
    text = SAMPLES[5] + SAMPLES[1]
    ids = vocab.encode(text)
    assert b"".join(llama_vocab.piece(t) for t in ids).decode() == text
    assert llama_vocab.piece(vocab.eos_id) == b""  # control tokens are not text


def test_llama_cpp_stops_at_either_end_token(llama_vocab: Any) -> None:
    v = llama_vocab.vocab
    assert llama_cpp.llama_vocab_bos(v) == 0
    assert llama_cpp.llama_vocab_eos(v) == 2
    assert llama_cpp.llama_vocab_is_eog(v, 2)  # <|im_end|> ends a chat reply
    assert llama_cpp.llama_vocab_is_eog(v, 0)  # <|endoftext|> ends a document
    assert not llama_cpp.llama_vocab_is_eog(v, 1)
    assert llama_cpp.llama_vocab_n_tokens(v) == 1000


def test_gguf_carries_the_bpe_tokenizer_and_chat_template(micro_gguf: Path) -> None:
    meta = read_metadata(micro_gguf)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert meta["tokenizer.ggml.bos_token_id"] == 0
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["llama.attention.head_count"] == 4
    assert meta["llama.attention.head_count_kv"] == 2
    reader = gguf.GGUFReader(micro_gguf)
    field = reader.get_field("tokenizer.ggml.merges")
    assert field is not None and len(field.data) == 1000 - 259
    types = reader.get_field("tokenizer.ggml.token_type")
    assert types is not None and list(types.contents()[:4]) == [3, 3, 3, 1]
    # the GQA projections are narrower than the query's
    shapes = {t.name: tuple(t.shape) for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight"] == (64, 64)
    assert shapes["blk.0.attn_k.weight"] == (64, 32)  # GGUF order: [in, out]
    config, _ = read_llama_gguf(micro_gguf)
    assert (config.n_head, config.kv_heads, config.vocab_size) == (4, 2, 1000)


def test_chat_tokens_are_what_llama_cpp_makes_of_the_rendered_template(
    llama_vocab: Any, vocab: BpeVocab, sources: list[Source]
) -> None:
    examples = chat_examples(sources, per_file=1, seed=0)
    assert len(examples) >= 5
    for example in examples[:5]:
        prompt = render_chat(example.messages, model_template=CHATML_TEMPLATE)
        assert prompt.template == "model"
        assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        served = llama_vocab.tokenize(prompt.text, special=True)
        trained = chat_tokens(example, vocab)
        assert trained[: len(served)] == served
        reply = trained[len(served) :]
        assert reply == [*vocab.encode(example.assistant), vocab.eos_id, *vocab.encode("\n")]


def test_chat_examples_are_seeded_and_answer_with_code(sources: list[Source]) -> None:
    a = chat_examples(sources, per_file=2, seed=3)
    assert a == chat_examples(sources, per_file=2, seed=3)
    assert a != chat_examples(sources, per_file=2, seed=4)
    for example in a:
        assert example.assistant.startswith(("def ", "class ", "async def "))
        assert example.user.startswith("Write the ")
        compile(example.assistant, "<chat>", "exec")  # a whole definition, not a fragment


def test_torch_forward_with_gqa_is_what_llama_cpp_computes(
    micro_gguf: Path, vocab: BpeVocab, sources: list[Source]
) -> None:
    # A kv-head grouping that differs from ggml's (h // group) shows as a large error.
    torch = pytest.importorskip("torch")
    from quantroute.demo.model import forward

    config, weights = read_llama_gguf(micro_gguf)
    ids = vocab.encode(sources[1].text, add_bos=True)[:96]
    params = {name: torch.from_numpy(w) for name, w in weights.items()}
    with torch.no_grad():
        ref = forward(params, config, torch.tensor([ids]))[0].numpy()  # [T, V]
    llm = llama_cpp.Llama(
        model_path=str(micro_gguf), n_ctx=128, n_threads=1, logits_all=True, verbose=False
    )
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])  # [T, V]
    llm.close()
    scale = float(ref.std())
    assert scale > 1.0  # peaky enough for attention to matter
    assert float(np.abs(ref - got).max()) < 0.1 * scale  # measured 0.016; h % kv_heads: 5.5
    assert (ref.argmax(-1) == got.argmax(-1)).mean() > 0.98

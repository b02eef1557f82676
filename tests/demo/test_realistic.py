"""The realistic demo model, stdlib-bpe-llama, as built (or reused) from the demo cache.

The first run builds it (about 10 minutes on 2 cores, hence the long timeout);
later runs reuse the cached build. Every test here reads the real files: the
GGUF metadata, llama.cpp's tokenizer, each branch decoding, the profile, and a
real ``quantroute serve`` process answering the OpenAI API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from qrtest import realistic_repo, serve_process
from quantroute.demo import (
    BPE_MODEL_NAME,
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    BpeBuildConfig,
    BpeVocab,
    cache_key,
    read_metadata,
)
from quantroute.quality.profile import load_profiles
from quantroute.quality.profiler import default_calibration_text
from quantroute.registry.manifest import load_manifest, verify_artifacts
from quantroute.shaping.chat_template import render_chat

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BRANCHES = ("f16", "q8_0", "q4_k_m")
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that writes Python."},
    {"role": "user", "content": "Write the function `dedent` of `textwrap`."},
]


@pytest.fixture(scope="module")
def repo() -> Path:
    return realistic_repo()


@pytest.fixture(scope="module")
def model_dir(repo: Path) -> Path:
    return repo / BPE_MODEL_NAME


@pytest.fixture(scope="module")
def vocab(model_dir: Path) -> BpeVocab:
    return BpeVocab.from_file(model_dir / "tokenizer.json")


# --- what was built --------------------------------------------------------------------


def test_it_has_the_shape_of_a_real_model(model_dir: Path) -> None:
    path = model_dir / "f16.gguf"
    meta = read_metadata(path)
    reader = gguf.GGUFReader(path)
    tokens_field = reader.get_field("tokenizer.ggml.tokens")
    assert tokens_field is not None
    tokens = tokens_field.contents()
    assert len(tokens) >= 32_000
    assert meta["llama.block_count"] >= 8
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    assert isinstance(n_head, int) and isinstance(n_kv, int)
    assert 1 <= n_kv < n_head and n_head % n_kv == 0  # grouped-query attention
    n_params = sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)
    assert n_params >= 20_000_000
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert tuple(tokens[:3]) == SPECIAL_TOKENS
    assert tokens[int(meta["tokenizer.ggml.eos_token_id"])] == "<|im_end|>"
    assert tokens[int(meta["tokenizer.ggml.bos_token_id"])] == "<|endoftext|>"
    types = reader.get_field("tokenizer.ggml.token_type")
    assert types is not None and list(types.contents()[:4]) == [3, 3, 3, 1]  # CONTROL x3
    merges = reader.get_field("tokenizer.ggml.merges")
    assert merges is not None and len(merges.data) > 30_000
    assert meta["general.name"] == BPE_MODEL_NAME


def test_the_repository_is_the_cached_build_of_the_default_config(
    repo: Path, model_dir: Path
) -> None:
    key = cache_key(BPE_MODEL_NAME, BpeBuildConfig(), 0)
    assert repo.name == key.folder
    assert json.loads((repo / "build.json").read_text())["key"] == key.digest
    manifest = load_manifest(model_dir)
    assert manifest.model == BPE_MODEL_NAME
    assert manifest.reference == "f16"
    artifacts = {a.name: a for a in verify_artifacts(model_dir, manifest)}
    assert set(artifacts) == set(BRANCHES)
    sizes = {n: a.size_bytes for n, a in artifacts.items()}
    assert sizes["f16"] > sizes["q8_0"] > sizes["q4_k_m"]
    assert sum(sizes.values()) > 20_000_000  # why it lives in a cache, not in git
    q = gguf.GGMLQuantizationType
    kinds = {
        n: {t.name: t.tensor_type for t in gguf.GGUFReader(a.path).tensors}
        for n, a in artifacts.items()
    }
    assert kinds["f16"]["blk.7.attn_k.weight"] == q.F16
    assert kinds["q8_0"]["blk.7.attn_k.weight"] == q.Q8_0
    assert kinds["q4_k_m"]["blk.0.attn_q.weight"] == q.Q4_K  # K-quants: rows of 256


def test_llama_cpp_tokenizes_as_the_trained_tokenizer(
    model_dir: Path, vocab: BpeVocab, llama_vocab_of: Callable[[Path], Any]
) -> None:
    llama = llama_vocab_of(model_dir / "q4_k_m.gguf")
    assert llama.lib.llama_vocab_n_tokens(llama.vocab) == vocab.size
    calibration = default_calibration_text()
    texts = [
        calibration,
        "def f(x):\n    return x + 1\n",
        "caf\u00e9 \u2603 \U0001f600 \u4e2d\u6587 it's 'll 12345",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "\t\t  \n\n   trailing   ",
    ]
    for text in texts:
        for special in (False, True):
            assert llama.tokenize(text, special=special) == vocab.encode(
                text, parse_special=special
            ), text[:60]
    ids = vocab.encode(calibration)
    assert len(ids) < len(calibration.encode()) / 3  # a real BPE: > 3 bytes a token
    assert vocab.decode(ids) == calibration


def _load(path: Path, **kwargs: Any) -> Any:
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, verbose=False, **kwargs)


@pytest.mark.parametrize("branch", BRANCHES)
def test_each_branch_loads_and_writes_code(model_dir: Path, branch: str) -> None:
    llm = _load(model_dir / f"{branch}.gguf")
    try:
        assert llm.n_vocab() >= 32_000
        assert llm.metadata["llama.context_length"] == "512"
        out = llm.create_completion(
            "import os\n\n\ndef main(argv):\n", max_tokens=12, temperature=0.0
        )
        assert out["usage"]["completion_tokens"] >= 1
        assert out["choices"][0]["text"].strip()
    finally:
        llm.close()


def test_a_chat_prompt_from_the_model_template_is_read_as_special_tokens(
    model_dir: Path, vocab: BpeVocab
) -> None:
    meta = read_metadata(model_dir / "q8_0.gguf")
    template = meta["tokenizer.chat_template"]
    assert isinstance(template, str)
    prompt = render_chat(MESSAGES, model_template=template, bos_token="<|endoftext|>")
    assert prompt.template == "model"
    llm = _load(model_dir / "q8_0.gguf")
    try:
        ids = llm.tokenize(prompt.text.encode(), add_bos=True, special=True)
        assert ids[:2] == [vocab.bos_id, vocab.im_start_id]
        assert ids.count(vocab.im_start_id) == 3  # system, user, and the assistant's turn
        assert ids.count(vocab.eos_id) == 2
        out = llm.create_completion(ids, max_tokens=48, temperature=0.0)
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert "<|im_start|>" not in choice["text"]  # control tokens are never text
    finally:
        llm.close()


def test_the_profile_shows_q4_k_m_further_from_the_reference_than_q8_0(model_dir: Path) -> None:
    manifest = load_manifest(model_dir)
    profiles, warnings = load_profiles(model_dir, verify_artifacts(model_dir, manifest))
    assert warnings == []
    f16, q8, q4 = (profiles[b] for b in BRANCHES)
    assert f16 is not None and q8 is not None and q4 is not None
    assert f16.mean_kld == 0.0
    assert 0 < q8.mean_kld < q4.mean_kld
    assert q4.mean_kld > 5 * q8.mean_kld
    assert q8.kld_p99 < q4.kld_p99
    assert q8.top1 > q4.top1
    assert q4.quality.n_tokens > 5000


# --- served ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_quantroute_serves_it_over_the_openai_api(repo: Path, vocab: BpeVocab) -> None:
    with serve_process(repo, "--engine-parallel", "2") as base:
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        ids = {m["id"] for m in models["data"]}
        assert {BPE_MODEL_NAME, *(f"{BPE_MODEL_NAME}:{b}" for b in BRANCHES)} <= ids

        body = {"model": BPE_MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-quantroute-branch"].startswith(f"{BPE_MODEL_NAME}:")
        chat = r.json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["choices"][0]["finish_reason"] in ("stop", "length")
        # the model's own template, its special tokens parsed: not the default "### User:"
        rendered = render_chat(MESSAGES, model_template=CHATML_TEMPLATE).text
        expected = vocab.encode(rendered, add_bos=True, parse_special=True)
        assert chat["usage"]["prompt_tokens"] == len(expected)
        assert 0 < chat["usage"]["completion_tokens"] <= 24

        body = {"model": f"{BPE_MODEL_NAME}:q4_k_m", "prompt": "def ", "max_tokens": 8}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-quantroute-branch"] == f"{BPE_MODEL_NAME}:q4_k_m"
        completion = r.json()
        assert completion["object"] == "text_completion"
        assert completion["usage"]["prompt_tokens"] == len(vocab.encode("def ", add_bos=True))
        assert 0 < completion["usage"]["completion_tokens"] <= 8

"""The real app (lifespan, routing, SSE) on real llama.cpp workers, in-process."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from qrtest import demo_model_dir, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.demo.gguf_export import copy_gguf_with_metadata
from quantroute.registry.manifest import sha256_file

pytestmark = pytest.mark.slow

EVIL = "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}"
CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _repo_with_template(root: Path, template: str) -> Path:
    """A one-branch model whose GGUF carries ``template`` as its chat template."""
    model = root / "templated"
    model.mkdir(parents=True)
    copy_gguf_with_metadata(
        demo_model_dir() / "q4_k_m.gguf",
        model / "q4_k_m.gguf",
        {"tokenizer.chat_template": template},
    )
    manifest = {
        "model": "templated",
        "reference": "q4_k_m",
        "branches": {
            "q4_k_m": {
                "file": "q4_k_m.gguf",
                "precision": "q4_k_m",
                "sha256": sha256_file(model / "q4_k_m.gguf"),
            }
        },
    }
    (model / "quantroute.yaml").write_text(yaml.safe_dump(manifest))
    return root


@contextlib.asynccontextmanager
async def _serve_repo(repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(load_settings(repo=repo, engine={"parallel": 2, "n_threads": 1}))
    async with serving(app) as (client, _):
        yield client


@pytest.fixture(scope="module")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_model_dir(), repo / "tiny-llama")
    return repo


@pytest.fixture
async def client(demo_repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with _serve_repo(demo_repo) as c:
        yield c


async def test_every_branch_answers_and_is_named(client: httpx.AsyncClient) -> None:
    ready = (await client.get("/readyz")).json()
    gguf, onnx = ("f16", "q8_0", "q4_k_m"), ("onnx_fp16", "onnx_int8", "onnx_int4")
    assert sorted(ready["ready_branches"]["tiny-llama"]) == sorted(gguf + onnx)
    for branch in gguf + onnx:
        r = await client.post(
            "/v1/completions",
            json={
                "model": f"tiny-llama:{branch}",
                "prompt": "def ",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
        assert r.headers["x-quantroute-branch"] == f"tiny-llama:{branch}"
        assert r.json()["usage"]["completion_tokens"] == 8


async def test_stream_equals_whole_and_n_choices_differ_by_seed(client: httpx.AsyncClient) -> None:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "prompt": "for i in ",
        "max_tokens": 30,
        "temperature": 0.8,
        "seed": 11,
        "n": 2,
        "ignore_eos": True,
    }
    whole = (await client.post("/v1/completions", json=body)).json()
    r = await client.post("/v1/completions", json=body | {"stream": True})
    texts = ["", ""]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert texts[0] != texts[1]  # seed + i per choice


@pytest.mark.parametrize(("chat", "logprobs"), [(False, False), (True, False), (True, True)])
async def test_streams_from_the_worker_equal_whole_responses(
    client: httpx.AsyncClient, chat: bool, logprobs: bool
) -> None:
    """A llama.cpp stream's plain tokens are handed from the worker's pipe to the stream
    store in the engine's task, a logprobs token or the end through the producer's: the
    same text as the whole response, every token counted, every event numbered."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "def"}]} if chat else {"prompt": "def "}
    extra: dict[str, Any] = {"logprobs": True} if logprobs else {}
    body = {"model": "tiny-llama:q8_0", "max_tokens": 40, "n": 2, "temperature": 0.0}
    body |= {"ignore_eos": True} | prompt | extra
    whole = (await client.post(path, json=body)).json()
    r = await client.post(
        path, json=body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 80
    for index in range(2):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        if chat:
            text = "".join(c["delta"].get("content") or "" for c in chunks)
            expected = whole["choices"][index]["message"]["content"]
        else:
            text = "".join(c["text"] for c in chunks)
            expected = whole["choices"][index]["text"]
        assert text == expected
        if logprobs:
            entries = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["content"]]
            assert len(entries) == 40
    ids = [int(x.rpartition("/")[2]) for x in r.text.splitlines() if x.startswith("id: ")]
    assert ids == list(range(len(events) + 1))  # [DONE] too


async def test_unsafe_chat_template_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    repo = _repo_with_template(tmp_path / "repo", EVIL.replace("MARKER", str(marker)))
    async with _serve_repo(repo) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": "templated",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
        )
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "chat_template_error"
        assert not marker.exists()
        ok = await c.post(
            "/v1/completions", json={"model": "templated", "prompt": "x", "max_tokens": 2}
        )
        assert ok.status_code == 200


async def test_model_chat_template_is_used(tmp_path: Path) -> None:
    repo = _repo_with_template(tmp_path / "repo", CHATML)
    async with _serve_repo(repo) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": "templated",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200
        # "<|user|>hi\n<|assistant|>" is 24 byte tokens, plus BOS
        assert r.json()["usage"]["prompt_tokens"] == 25


async def test_models_list_shows_profiles_and_stale_ones(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    model = (await client.get("/v1/models")).json()["data"][0]
    assert model["reference"] == "f16" and model["profile_warnings"] == []
    profiles = {b["branch"]: b["profile"] for b in model["branches"]}
    assert profiles["f16"]["mean_kld"] == 0.0
    assert 0 < profiles["q8_0"]["mean_kld"] < profiles["q4_k_m"]["mean_kld"]
    assert profiles["q8_0"]["top1"] > profiles["q4_k_m"]["top1"]
    # The ONNX Runtime branches sit on the same axis, each with its engine named.
    engines = {b["branch"]: b["engine"] for b in model["branches"]}
    assert {engines[n] for n in ("f16", "q8_0", "q4_k_m")} == {"llamacpp"}
    assert {engines[n] for n in ("onnx_fp16", "onnx_int8", "onnx_int4")} == {"onnxruntime"}
    assert 0 < profiles["onnx_fp16"]["mean_kld"] < 1e-5  # the f16 weights, another engine
    kld = [profiles[n]["mean_kld"] for n in ("onnx_fp16", "onnx_int8", "onnx_int4")]
    assert kld == sorted(kld)
    # A branch file that changed since profiling has no profile, and the server says why.
    repo = tmp_path / "repo"
    shutil.copytree(demo_model_dir(), repo / "tiny-llama")
    q4 = repo / "tiny-llama" / "q4_k_m.gguf"
    copy_gguf_with_metadata(demo_model_dir() / "q4_k_m.gguf", q4, {"general.note": "changed"})
    manifest_path = repo / "tiny-llama" / "quantroute.yaml"
    manifest = yaml.safe_load(manifest_path.read_text())
    manifest["branches"]["q4_k_m"]["sha256"] = sha256_file(q4)
    manifest_path.write_text(yaml.safe_dump(manifest))
    async with _serve_repo(repo) as c:
        model = (await c.get("/v1/models")).json()["data"][0]
        profiles = {b["branch"]: b["profile"] for b in model["branches"]}
        assert profiles["q4_k_m"] is None and profiles["q8_0"] is not None
        assert any("q4_k_m" in w for w in model["profile_warnings"])

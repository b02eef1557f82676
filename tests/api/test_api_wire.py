"""The app end to end in-process (ASGI), on fake engines: wire format and errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine, FakeFaults


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with _client({n: FakeEngine() for n in ("f16", "q8_0", "q4_k_m")}) as c:
        yield c


@contextlib.asynccontextmanager
async def _client(engines: dict[str, Any], **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        load_settings(**({"server": {"max_body_bytes": 4096}} | settings)), fake_table(engines)
    )
    async with serving(app) as (client, _):
        yield client


def _events(body: str) -> list[Any]:
    out: list[Any] = []
    for line in body.splitlines():  # events carry id: (and the first retry:) lines too
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_chat_non_stream_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-quantroute-branch"] == "tiny-llama:f16"
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "def f"}
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


async def test_chat_stream_wire_format(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama:q8_0",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "def "
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream_without_usage_and_with_stop(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny-llama",
            "prompt": "x",
            "max_tokens": 20,
            "stream": True,
            "stop": ["():"],
        },
    )
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    assert "usage" not in events[0]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == "def fake"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_n_choices_and_several_prompts(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny-llama",
            "prompt": ["a", "bb"],
            "n": 2,
            "max_tokens": 3,
        },
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "def" for c in body["choices"])
    # prompts of 1 and 2 characters are 2 and 3 fake tokens, each counted once
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 12,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},  # the fake engine caches nothing
    }


async def test_logprobs_in_both_formats(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny-llama", "prompt": "a", "max_tokens": 2, "logprobs": 1},
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["d", "e"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 1]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 2,
            "logprobs": True,
        },
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["d", "e"]
    assert content[0]["bytes"] == [100]


BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "tiny-llama:q3", "prompt": "x"}, 404, "model", "model_not_found"),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 600},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 600},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "temperature": 2.5},
        400,
        "temperature",
        None,
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 5}, 400, "n", None),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 10**6},
        400,
        "max_tokens",
        None,
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": "8"},
        400,
        "max_tokens",
        None,
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop",
        None,
    ),
    ("/v1/completions", {"model": "tiny-llama", "prompt": 7}, 400, "prompt", None),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "unknown_knob": 1},
        400,
        "unknown_knob",  # a plain name is named, as OpenAI names it; its value never
        None,
    ),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        None,
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        400,
        "top_logprobs",  # the field the check across fields blames
        None,
    ),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x" * 5000},
        413,
        None,
        "payload_too_large",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors_and_the_next_request_works(
    client: httpx.AsyncClient,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code
    for secret in ("nope", "hot", "wizard", "unknown_knob=1", "xxxxxxxx"):
        if secret not in (param or ""):
            assert secret not in error["message"]
    ok = await client.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
    )
    assert ok.status_code == 200


async def test_chunked_body_over_the_limit_is_413(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = await client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"


async def test_models_health_and_readiness(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    ids = [m["id"] for m in models["data"]]
    assert ids[0] == "tiny-llama" and {"tiny-llama:f16", "tiny-llama:q4_k_m"} <= set(ids)
    assert [b["branch"] for b in models["data"][0]["branches"]] == ["f16", "q8_0", "q4_k_m"]
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).status_code == 200


async def test_not_ready_model_is_503_and_unready_readiness() -> None:
    engines = {n: FakeEngine(faults=FakeFaults(unavailable=True)) for n in ("f16", "q8_0")}
    async with _client(engines) as c:
        r = await c.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert (await c.get("/readyz")).status_code == 503


async def test_failure_before_first_token_falls_back_to_next_branch() -> None:
    # crash_after=0: the branch accepts the prompt, then dies before its first token.
    # The commit point is the first token: the request moves to the next branch.
    broken = FakeEngine(faults=FakeFaults(crash_after=0))
    async with _client({"f16": broken, "q8_0": FakeEngine()}) as c:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "stream": True}
        r = await c.post("/v1/completions", json=body | {"quality": "fast"})
        assert r.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
        events = _events(r.text)
        assert events[-1] == "[DONE]" and "error" not in str(events)


async def test_failure_after_the_first_token_ends_the_stream_with_an_error() -> None:
    broken = FakeEngine(faults=FakeFaults(crash_after=1))
    async with _client({"f16": broken, "q8_0": FakeEngine()}) as c:
        r = await c.post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "stream": True},
        )
        assert r.headers["x-quantroute-branch"] == "tiny-llama:f16"
        events = _events(r.text)
        assert "[DONE]" not in events
        assert events[0]["choices"][0]["text"] == "d"  # the token the client already has
        assert events[-1]["error"]["code"] == "engine_crashed"


async def test_a_branch_failing_before_its_first_token_falls_back_to_the_next() -> None:
    refusing = FakeEngine(faults=FakeFaults(refuse=True))  # ready, but fails every request
    async with _client({"f16": refusing, "q8_0": FakeEngine()}) as c:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "fast"}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200
        assert r.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
        # Without a profile, q8_0 cannot vouch for the default tier's bound: only f16
        # qualifies, and when it fails there is nothing to fall back to.
        r = await c.post("/v1/completions", json=body | {"quality": "balanced"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


async def test_idle_stream_gets_keepalive_comments() -> None:
    slow = FakeEngine(token_delay_s=0.15)
    async with _client({"f16": slow}, server={"keepalive_s": 0.05, "max_body_bytes": 4096}) as c:
        r = await c.post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "stream": True},
        )
        assert ": keep-alive" in r.text
        assert _events(r.text)[-1] == "[DONE]"

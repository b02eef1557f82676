"""Hostile input, case by case: every number in every numeric field, every odd string
in every string field, every malformed header, on every generation endpoint; the
cases the hostile-input run found; a 500 that keeps the connection; and the
sampler's edge parameters on real llama.cpp workers.

The answer is always a success or a 4xx in OpenAI's shape, never the request
echoed (``check_answer``, shared with the property tests).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

# The answer checks are the property tests' (tests/ is on the path; tests/api is not).
from api.test_api_properties import HEADER_MARK, MARK, check_answer, post_json
from qrtest import demo_model_dir, fake_app, fake_table, live, serving
from quantroute.api.app import create_app
from quantroute.api.errors import InternalErrorMiddleware
from quantroute.api.schemas import MAX_JSON_DEPTH
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
}
COMPLETION: dict[str, Any] = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 3}
ENDPOINTS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", COMPLETION),
    ("/v1/route/explain", CHAT),
    ("/v1/route/explain", COMPLETION),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serving(fake_app()) as (c, _):
        yield c


# ---- every odd value in every field ----------------------------------------------------------

EDGE_NUMBERS: list[Any] = [
    0,
    -0.0,
    1,
    -1,
    5e-324,
    -5e-324,
    1e-320,
    1e-308,
    2.0000000001,
    1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    -(10**400),
    True,
    "1",
]


def _set(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    target: Any = out
    for key in path[:-1]:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[path[-1]] = value
    return out


NUMERIC = [
    ("max_tokens",),
    ("temperature",),
    ("top_p",),
    ("top_k",),
    ("n",),
    ("seed",),
    ("timeout",),
    ("presence_penalty",),
    ("frequency_penalty",),
    ("quality", "max_kld"),
    ("quality", "min_top1"),
    ("logit_bias", "7"),
]
CHAT_NUMERIC = [("max_completion_tokens",), ("top_logprobs",)]


async def test_every_edge_number_in_every_numeric_field(client: httpx.AsyncClient) -> None:
    seen: set[int] = set()
    for path, base in ENDPOINTS:
        fields = NUMERIC + (CHAT_NUMERIC if "messages" in base else [("logprobs",)])
        for field in fields:
            for value in EDGE_NUMBERS:
                body = _set(base, field, value)
                if field == ("top_logprobs",):
                    body["logprobs"] = True
                r = await post_json(client, path, body)
                check_answer(r)
                seen.add(r.status_code)
    assert {200, 400} <= seen


ODD_STRINGS = [
    "",
    " ",
    "²",
    "٣",
    "\ud800",
    "\udfff",
    "\x00",
    "\u202e",
    "NaN",
    "1e400",
    "𝟘",  # noqa: RUF001
    "a" * 300,
    MARK,
    MARK + "\ud800",
]
STRING_FIELDS = [
    ("model",),
    ("user",),
    ("stop",),
    ("quality",),
    ("messages", 0, "content"),
    ("messages", 0, "role"),
    ("messages", 0, "name"),
    ("prompt",),
]


async def test_every_odd_string_in_every_string_field(client: httpx.AsyncClient) -> None:
    for path, base in ENDPOINTS:
        for field in STRING_FIELDS:
            if (field[0] == "messages") != ("messages" in base) and field[0] in {
                "messages",
                "prompt",
            }:
                continue
            for value in ODD_STRINGS:
                check_answer(await post_json(client, path, _set(base, field, value)))
            check_answer(await post_json(client, path, _set(base, ("logit_bias",), {value: 1})))


ODD_HEADERS = [
    "",
    "nan",
    "inf",
    "-1",
    "0",
    "1e400",
    "9" * 500,
    "0x10",
    "1_000",
    "٣",
    "²",
    "max_kld=",
    "max_kld=1e999",
    "max_kld=0.1,max_kld=0.1",
    "min_top1=nan",
    "max_kld=0.01,bogus=1",
    HEADER_MARK,
]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama:q8_0"])
@pytest.mark.parametrize("header", ["x-quantroute-deadline-ms", "x-quantroute-quality"])
async def test_malformed_routing_headers_are_400_routed_or_pinned(
    client: httpx.AsyncClient, model: str, header: str
) -> None:
    for value in ODD_HEADERS:
        for path, base in ENDPOINTS[:2]:  # explain of a pinned branch reads no headers
            r = await post_json(client, path, base | {"model": model}, {header: value})
            check_answer(r)
            assert r.status_code == 400, (path, value, r.text)
            assert r.json()["error"]["param"] == header


# ---- the cases the hostile-input run found -------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "param"),
    [
        (("quality", "max_kld"), "quality.max_kld"),
        (("quality", "min_top1"), "quality.min_top1"),
        (("timeout",), "timeout"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/route/explain"])
async def test_integers_past_every_float_are_400_naming_the_field(
    client: httpx.AsyncClient, field: tuple[str, ...], param: str, path: str
) -> None:
    r = await post_json(client, path, _set(CHAT, field, 10**400))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("key", ["²", "٣", "１", "1²", " 1", "-1", "1" * 10])  # noqa: RUF001
async def test_logit_bias_keys_must_be_ascii_token_ids(client: httpx.AsyncClient, key: str) -> None:
    r = await post_json(client, "/v1/chat/completions", CHAT | {"logit_bias": {key: 1}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
async def test_deep_nesting_is_400_on_every_endpoint(client: httpx.AsyncClient, depth: int) -> None:
    for raw in (b"[" * depth + b"]" * depth, b"[" * depth):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/route/explain"):
            r = await client.post(path, content=raw, headers={"content-type": "application/json"})
            check_answer(r)
            assert r.status_code == 400


async def test_route_explain_takes_nesting_up_to_the_bound(client: httpx.AsyncClient) -> None:
    value: Any = "fast"
    for _ in range(MAX_JSON_DEPTH - 2):
        value = [value]
    r = await post_json(client, "/v1/route/explain", CHAT | {"quality": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "quality"  # parsed, then refused


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
@pytest.mark.parametrize("content", ["missing", None, []])
async def test_a_message_without_content_is_400(
    client: httpx.AsyncClient, role: str, content: Any
) -> None:
    message: dict[str, Any] = {"role": role}
    if content != "missing":
        message["content"] = content
    body = CHAT | {"messages": [{"role": "user", "content": "hi"}, message]}
    for path in ("/v1/chat/completions", "/v1/route/explain"):
        r = await post_json(client, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.1.content"


async def test_empty_string_content_is_still_a_message(client: httpx.AsyncClient) -> None:
    body = CHAT | {
        "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "x"}]
    }
    assert (await post_json(client, "/v1/chat/completions", body)).status_code == 200


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-308, 2.0])
async def test_subnormal_temperatures_are_served(
    client: httpx.AsyncClient, temperature: float
) -> None:
    r = await post_json(client, "/v1/chat/completions", CHAT | {"temperature": temperature})
    assert r.status_code == 200


async def test_lone_surrogates_are_400_not_an_encoder_crash(client: httpx.AsyncClient) -> None:
    raw = b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 2}'
    r = await client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_unknown_fields_are_named_only_when_their_names_are_plain(
    client: httpx.AsyncClient,
) -> None:
    r = await post_json(client, "/v1/chat/completions", CHAT | {"colour": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "colour"  # a plain name
    r = await post_json(client, "/v1/chat/completions", CHAT | {"colour of it": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] is None  # the client's text
    assert "colour" not in r.text
    for known in ("reasoning_effort", "echo", "prompt"):  # OpenAI's, or the other endpoint's
        r = await post_json(client, "/v1/chat/completions", CHAT | {known: 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == known
    r = await post_json(client, "/v1/chat/completions", CHAT | {"priority": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = await post_json(client, "/v1/chat/completions", CHAT | {f"<script>{MARK}": 1})
    check_answer(r)
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    r = await post_json(client, "/v1/chat/completions", CHAT | {"logit_bias": {"12": 500}})
    assert r.json()["error"]["param"] == "logit_bias.12"  # a token id is safe to name


async def test_content_length_past_any_int_is_413(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        content=json.dumps(COMPLETION).encode(),
        headers={"content-type": "application/json", "content-length": "9" * 5000},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": "x"}] * 1025},
            "messages",
        ),
        ("/v1/chat/completions", CHAT | {"max_tokens": 65}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "tiny-llama", "messages": CHAT["messages"], "max_completion_tokens": 10**400},
            "max_completion_tokens",  # the field the client gave
        ),
        ("/v1/chat/completions", CHAT | {"n": 10**400}, "n"),
        ("/v1/chat/completions", CHAT | {"stop": ["a"] * 5}, "stop"),
        ("/v1/chat/completions", CHAT | {"stop": "a" * 257}, "stop"),
        ("/v1/completions", COMPLETION | {"prompt": ["a"] * 5}, "prompt"),
        ("/v1/completions", COMPLETION | {"prompt": ["a", "b"], "n": 3}, "prompt"),
        ("/v1/route/explain", COMPLETION | {"prompt": ["a"] * 5}, "prompt"),
    ],
)
async def test_limits_from_settings_are_400_naming_the_field(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await post_json(client, path, body)
    check_answer(r)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


TOOL = {"type": "function", "function": {"name": "f"}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "date"}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", COMPLETION | {"echo": True}, "echo"),
        ("/v1/completions", COMPLETION | {"prompt": []}, "prompt"),
        (
            "/v1/completions",
            COMPLETION | {"stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            CHAT | {"max_tokens": 4, "max_completion_tokens": 4},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", CHAT | {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", CHAT | {"tools": [TOOL, TOOL]}, "tools"),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "tool", "content": "x"}]},
            "messages.0.tool_call_id",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": SCHEMA_FORMAT},
            "response_format.json_schema",
        ),
        ("/v1/chat/completions", CHAT | {"user": "u" * 257}, "user"),
    ],
)
async def test_a_check_across_fields_names_the_field_it_blames(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await post_json(client, path, body)
    check_answer(r)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and "Value should" not in error["message"]


async def test_a_deadline_too_short_to_meet_is_not_the_branchs_failure() -> None:
    engines = {n: FakeEngine(token_delay_s=0.02) for n in ("f16", "q8_0", "q4_k_m")}
    app = create_app(load_settings(telemetry={"devices": "sim:1x24GiB"}), fake_table(engines))
    async with serving(app) as (c, _):
        for _ in range(12):  # a valid deadline: 2 ms
            r = await post_json(
                c,
                "/v1/completions",
                COMPLETION | {"model": "tiny-llama:q8_0"},
                {"x-quantroute-deadline-ms": "2"},
            )
            check_answer(r)
        r = await post_json(c, "/v1/completions", COMPLETION | {"model": "tiny-llama:q8_0"})
        assert r.status_code == 200  # another client's request, without a deadline


# ---- a 500 keeps the connection ----------------------------------------------------------------


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], bytes]:
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


async def test_an_unexpected_error_is_a_500_body_and_the_connection_stays_open() -> None:
    app = create_app(load_settings(telemetry={"devices": "sim:1x24GiB"}), fake_table())

    async def boom() -> None:
        raise RuntimeError(f"a bug, with {MARK} in its message")

    app.add_api_route("/boom", boom)
    async with live(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            get = b"GET %s HTTP/1.1\r\nhost: localhost\r\n\r\n"
            status, headers, body = await _exchange(reader, writer, get % b"/boom")
            assert status == 500
            assert headers.get("connection", "keep-alive") != "close"
            assert json.loads(body) == {
                "error": {
                    "message": "The server had an internal error.",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
            assert MARK.encode() not in body
            raw = json.dumps(CHAT | {"temperature": 10**400}).encode()
            post = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            )
            status, _, _ = await _exchange(reader, writer, post % (len(raw), raw))
            assert status == 400  # the same connection, still open
            status, _, body = await _exchange(reader, writer, get % b"/healthz")
            assert status == 200 and json.loads(body) == {"status": "ok"}
        finally:
            writer.close()


async def test_an_error_after_the_response_started_still_cuts_the_stream() -> None:
    async def streaming_then_boom(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-stream")

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    middleware = InternalErrorMiddleware(streaming_then_boom)
    with pytest.raises(RuntimeError, match="mid-stream"):
        await middleware({"type": "http", "method": "GET", "path": "/"}, _no_receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"]  # no second response


async def _no_receive() -> Any:
    raise AssertionError("not read")


# ---- the sampler's edges on real llama.cpp workers --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-320},
        {"temperature": 5e-324, "top_p": 5e-324},
        {"temperature": 2.0, "top_p": 1.0, "top_k": 1000},
        {"temperature": 1e-3, "top_k": 1},
        {"temperature": 1.5, "logit_bias": {str(t): 100 for t in range(0, 256, 3)}},
        {"temperature": 0.7, "logit_bias": {str(t): -100 for t in range(300)}},
        {"temperature": 1e-308, "logprobs": True, "top_logprobs": 20},
    ],
    ids=lambda s: ",".join(f"{k}={v if not isinstance(v, dict) else len(v)}" for k, v in s.items()),
)
async def test_sampler_edges_on_real_workers_answer_and_keep_the_worker(
    llama: httpx.AsyncClient, sampling: dict[str, Any]
) -> None:
    body = {
        "model": "tiny-llama:q4_k_m",
        "messages": [{"role": "user", "content": "def f():"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "seed": 3,
    } | sampling
    r = await llama.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 6
    for entry in (choice.get("logprobs") or {}).get("content", []):
        assert entry["logprob"] <= 0.0 and all(t["logprob"] <= 0.0 for t in entry["top_logprobs"])
    # the worker that sampled it is alive and well
    again = await llama.post(
        "/v1/completions", json={"model": "tiny-llama:q4_k_m", "prompt": "x", "max_tokens": 2}
    )
    assert again.status_code == 200
    ready = (await llama.get("/readyz")).json()
    assert "q4_k_m" in ready["ready_branches"]["tiny-llama"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llama(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_model_dir(), repo / "tiny-llama")
    app = create_app(load_settings(repo=repo, engine={"parallel": 2, "n_threads": 1}))
    async with serving(app) as (c, _):
        yield c


LONG_BAD_LISTS = [
    ("/v1/completions", {"prompt": [True] * 150_000}, "prompt"),  # all under 1 MiB
    ("/v1/completions", {"prompt": [[True]] * 100_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{}] * 150_000}, "messages.0.role"),
    ("/v1/chat/completions", {"stop": [""] * 200_000}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{}] * 150_000}]}, None),
]


@pytest.mark.parametrize(("path", "fields", "param"), LONG_BAD_LISTS)
async def test_a_long_list_of_bad_items_is_one_error_not_one_per_item(
    client: httpx.AsyncClient, path: str, fields: dict[str, Any], param: str | None
) -> None:
    """pydantic made one error per bad item, and turning 750,000 of them into dicts held
    the event loop for seconds (a 1 MB body): a list stops at its first bad item."""
    from pydantic import ValidationError

    from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest, parse_body

    base = CHAT if path == "/v1/chat/completions" else {"model": "tiny-llama", "prompt": "x"}
    body = base | fields
    schema = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
    with pytest.raises(ValidationError) as caught:
        parse_body(json.dumps(body).encode(), schema)
    assert caught.value.error_count() <= 8
    r = await post_json(client, path, body)
    assert r.status_code == 400
    if param is not None:
        assert (r.json()["error"]["param"] or "").startswith(param.split(".")[0]), r.text


async def test_a_client_that_leaves_mid_body_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Each such connection logged an ERROR with a traceback: a way to flood the log."""
    async with live(fake_app()) as port:
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"
                b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
            )
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/healthz")).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

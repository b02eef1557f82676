"""A response's chunks written straight to its connection (``api/direct.py``), under a real
uvicorn on a real socket: only between the first body and the end, never past a full
socket buffer or a client that left, through no layer that touches bodies; and a stream
written this way arrives whole and numbered."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from qrtest import fake_app, live
from quantroute.api.app import HeadWithBody
from quantroute.api.direct import EXTENSION, DirectBody

Scope = dict[str, Any]

# Every layer a response's bodies pass between the server and the routes. Each one must
# leave bodies alone, or drop the direct body from the scope (docs/architecture.md).
LAYERS = [
    "quantroute.api.app.HeadWithBody",
    "starlette.middleware.errors.ServerErrorMiddleware",  # notes that a response started
    "fastapi.telemetry._asgi.ExceptionTelemetryMiddleware",  # exceptions only (off)
    "fastapi._body_limit.AppBodyLimitMiddleware",  # the request's body
    "quantroute.api.gate.RequestGate",  # the request's head; its own answer, whole
    "quantroute.api.body_limit.BodyLimitMiddleware",  # the request's body
    "quantroute.api.errors.InternalErrorMiddleware",  # notes that a response started
    "quantroute.api.routes.GenerationRoutes",
    "starlette.middleware.exceptions.ExceptionMiddleware",  # notes that a response started
    "fastapi.middleware.asyncexitstack.AsyncExitStackMiddleware",  # no send at all
    "fastapi.routing.APIRouter",
]


def test_every_layer_in_front_of_the_routes_leaves_response_bodies_alone() -> None:
    layer: Any = fake_app().build_middleware_stack()
    names = []
    while hasattr(layer, "app"):
        names.append(f"{type(layer).__module__}.{type(layer).__name__}")
        layer = layer.app
    # A new layer here must be checked against the direct body's rule, then listed.
    assert names == LAYERS


def _lifespan_or(app: Any) -> Any:
    """``app`` for HTTP, and the lifespan protocol answered (uvicorn runs it)."""

    async def asgi(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

    return HeadWithBody(asgi)


def _chunks(raw: bytes) -> list[bytes]:
    """The chunks of a chunked HTTP/1.1 response's body, in order."""
    _, _, body = raw.partition(b"\r\n\r\n")
    out = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


async def _get(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    return reader, writer


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        more = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert more, "the server closed the connection"
        data += more
    return data


async def test_it_writes_only_between_the_first_body_and_the_end() -> None:
    said: dict[str, bool] = {}

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        direct: DirectBody = scope["extensions"][EXTENSION]
        said["before the head"] = direct.write(b"early")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        said["before the first body"] = direct.write(b"corked")
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        said["after it"] = direct.write(b"two")
        await send({"type": "http.response.body", "body": b"three", "more_body": False})
        said["after the end"] = direct.write(b"late")

    async with live(_lifespan_or(app)) as port:
        reader, writer = await _get(port)
        try:
            assert _chunks(await _read_all(reader)) == [b"one", b"two", b"three"]
        finally:
            writer.close()
    assert said == {
        "before the head": False,
        "before the first body": False,
        "after it": True,
        "after the end": False,
    }


async def test_it_refuses_once_the_socket_is_full_and_send_goes_on_in_order() -> None:
    """A client that reads nothing: the connection's buffers fill, the direct writes stop
    (uvicorn's flow control), ``send`` waits for the client; nothing is lost or reordered."""
    refused = asyncio.Event()
    piece = b"x" * 65_000

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        direct: DirectBody = scope["extensions"][EXTENSION]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"0:" + piece, "more_body": True})
        n = 1
        while n < 512 and direct.write(b"%d:" % n + piece):
            n += 1
        refused.set()
        for i in range(n, n + 3):  # the rest through send, which waits for room
            chunk = b"%d:" % i + piece
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with live(_lifespan_or(app)) as port:
        reader, writer = await _get(port)
        try:
            await asyncio.wait_for(refused.wait(), 10)  # before the client read a byte
            chunks = _chunks(await _read_all(reader))
        finally:
            writer.close()
    assert 1 < len(chunks) - 3 < 512  # some written directly, then refused (~32 MB cap)
    assert [c.partition(b":")[0] for c in chunks] == [b"%d" % i for i in range(len(chunks))]
    assert all(c.endswith(piece) for c in chunks)


async def test_it_refuses_once_the_client_has_gone() -> None:
    said: list[bool] = []
    done = asyncio.Event()

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        direct: DirectBody = scope["extensions"][EXTENSION]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        said.append(direct.write(b"two"))
        while (await receive())["type"] != "http.disconnect":
            pass
        said.append(direct.write(b"three"))
        done.set()

    async with live(_lifespan_or(app)) as port:
        reader, writer = await _get(port)
        assert b"two" in await asyncio.wait_for(reader.readuntil(b"two\r\n"), 10)
        writer.close()
        await asyncio.wait_for(done.wait(), 10)
    assert said == [True, False]


async def test_a_response_with_a_content_length_is_never_written_to() -> None:
    said: list[bool] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        direct: DirectBody = scope["extensions"][EXTENSION]
        headers = [(b"content-length", b"6")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        said.append(direct.write(b"two"))  # not chunked: a chunk's framing would corrupt it
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    async with live(_lifespan_or(app)) as port:
        reader, writer = await _get(port)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            body = await asyncio.wait_for(reader.readexactly(6), 10)
        finally:
            writer.close()
    assert b"content-length: 6" in head.lower() and body == b"oneend"
    assert said == [False]


async def test_under_h11_none_is_offered() -> None:
    offered: list[bool] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        offered.append(EXTENSION in (scope.get("extensions") or {}))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async with live(_lifespan_or(app), http="h11") as port, httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
    assert offered == [False]


async def test_without_uvicorns_httptools_cycle_none_is_offered() -> None:
    async def send(message: dict[str, object]) -> None:  # a plain function: no cycle
        pass

    assert DirectBody.of(send) is None


async def test_a_stream_under_uvicorn_goes_out_directly_and_arrives_whole_and_numbered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: list[bool] = []
    real = DirectBody.write

    def spy(self: DirectBody, body: bytes) -> bool:  # the real write, counted
        ok = real(self, body)
        written.append(ok)
        return ok

    monkeypatch.setattr(DirectBody, "write", spy)
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 48, "stream": True}
    app = fake_app()
    for branch in app.state.gateway.routes.current.models["tiny-llama"].branches:
        branch.engine.token_delay_s = 0.002  # a token every 2 ms: the reader keeps up
    async with live(app) as port, httpx.AsyncClient(timeout=30) as client:
        base = f"http://127.0.0.1:{port}"
        whole = (await client.post(f"{base}/v1/completions", json=body | {"stream": False})).json()
        r = await client.post(f"{base}/v1/completions", json=body)
    assert sum(written) > 24  # most tokens went out directly
    lines = r.text.splitlines()
    ids = [int(x.rpartition("/")[2]) for x in lines if x.startswith("id: ")]
    events = [x[6:] for x in lines if x.startswith("data: ")]
    assert ids == list(range(len(events))) and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"] and len(re.findall(r"retry: ", r.text)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
async def test_a_llamacpp_stream_goes_out_from_the_engines_reader_and_equals_the_whole(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """A real worker's tokens are written to the socket by the engine's pipe-reading task, the
    task that read them (or the stream's producer): the same text as the whole response,
    every event numbered."""
    from quantroute.api.app import create_app
    from quantroute.config import DEMO_REPO, load_settings

    tasks: list[str] = []
    real = DirectBody.write

    def spy(self: DirectBody, body: bytes) -> bool:
        ok = real(self, body)
        task = asyncio.current_task()
        if ok and task is not None:
            tasks.append(task.get_name())
        return ok

    monkeypatch.setattr(DirectBody, "write", spy)
    app = create_app(load_settings(repo=DEMO_REPO, engine={"parallel": 2, "n_threads": 1}))
    body = {"model": "tiny-llama:q8_0", "prompt": "def ", "max_tokens": 40, "n": n}
    body |= {"temperature": 0.0, "ignore_eos": True}
    async with live(app) as port, httpx.AsyncClient(timeout=60) as client:
        base = f"http://127.0.0.1:{port}"
        whole = (await client.post(f"{base}/v1/completions", json=body)).json()
        r = await client.post(f"{base}/v1/completions", json=body | {"stream": True})
    lines = r.text.splitlines()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    # Tokens read together from the pipe make one event, so count events, not tokens. The
    # first (with the head) goes through send; the rest directly, from the engine's reader
    # or, for the end and whatever comes while the producer is awake, the producer's task.
    assert len(tasks) >= (len(events) - 2 * n) // 2
    assert tasks.count("read:tiny-llama:q8_0") > 0
    assert all(t.startswith("stream:") for t in tasks if t != "read:tiny-llama:q8_0")
    for index in range(n):
        text = "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)
        assert text == whole["choices"][index]["text"]
    ids = [int(x.rpartition("/")[2]) for x in lines if x.startswith("id: ")]
    assert ids == list(range(len(events) + 1))  # [DONE] too


async def test_a_streams_end_goes_out_in_one_chunk() -> None:
    """The last chunk (its finish reason), the usage and ``[DONE]`` come out of one producer
    step and go out as one chunk of the response, one socket write, not three."""
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 24, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    payload = json.dumps(body).encode()
    app = fake_app()
    for branch in app.state.gateway.routes.current.models["tiny-llama"].branches:
        branch.engine.token_delay_s = 0.002  # the reader keeps up: its events go directly
    async with live(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"
        head += b"content-type: application/json\r\n"
        writer.write(head + b"content-length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        try:
            chunks = _chunks(await _read_all(reader))
        finally:
            writer.close()
    last = chunks[-1]  # (with the last token, where it came with the end)
    assert last.count(b"id: ") >= 3 and last.endswith(b"data: [DONE]\n\n")
    *_, finish, usage = (json.loads(x[6:]) for x in last.split(b"\n") if x.startswith(b"data: {"))
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["usage"] is None and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 24
    assert len(chunks) > 10  # the tokens before it came one or a few a chunk

"""The request body's clock (``api/protocol.py``) over real sockets: a body that
trickles in is a 408 and its connection closes; one that comes in time is served; each
request on a kept-alive connection has its own clock; ``quantroute serve`` applies
``server.body_timeout_s``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

from qrtest import demo_model_dir, fake_app, live, serve_process
from quantroute.api.protocol import bounded

TIMEOUT_S = 0.5
MARGIN_S = 2.0  # the most a 408 may come after the clock ran out (a loaded machine)
WAIT_S = 10.0  # the longest any read waits: before the change, a trickled body hangs
COMPLETION = json.dumps({"model": "tiny-llama:f16", "prompt": "x", "max_tokens": 4}).encode()


def _bounded(app: object) -> Any:
    return live(app, http=bounded(8192, 15.0, body_timeout_s=TIMEOUT_S))  # type: ignore[arg-type]


def _post(length: int, path: bytes = b"/v1/completions") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (path, length)
    )


_CHUNKED = (
    b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_GET = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n"


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response with a content-length: its status, headers and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    status_line, *lines = head[:-4].split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines)
    body = await asyncio.wait_for(reader.readexactly(int(headers[b"content-length"])), WAIT_S)
    return int(status_line.split(b" ", 2)[1]), headers, body


async def _in_pieces(writer: asyncio.StreamWriter, data: bytes, pieces: int, gap_s: float) -> None:
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        if i:
            await asyncio.sleep(gap_s)
        writer.write(data[i : i + step])
        await writer.drain()


async def _trickle(writer: asyncio.StreamWriter, gap_s: float = 0.1) -> None:
    """A body a byte at a time, until the server hangs up (or the test stops it)."""
    with contextlib.suppress(ConnectionError):
        for _ in range(10_000):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(gap_s)


@contextlib.asynccontextmanager
async def _connection(port: int) -> Any:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _assert_408(reader: asyncio.StreamReader, since: float) -> float:
    """The 408 in OpenAI's shape, then the end of the connection: the seconds it took."""
    status, headers, body = await _response(reader)
    took = time.monotonic() - since
    assert status == 408
    assert headers[b"connection"] == b"close" and headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout"
    assert error["param"] is None and isinstance(error["message"], str)
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed, nothing after it
    assert TIMEOUT_S - 0.05 <= took < TIMEOUT_S + MARGIN_S
    return took


async def _stalled_body_is_a_408(reader: asyncio.StreamReader, writer: Any) -> None:
    """A request whose head comes and whose body stops short (control: the clock is live)."""
    writer.write(_post(len(COMPLETION)) + COMPLETION[:5])
    since = time.monotonic()
    await writer.drain()
    await _assert_408(reader, since)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logged() -> Iterator[list[logging.LogRecord]]:
    """What uvicorn and quantroute log meanwhile, INFO and up (``live`` sets uvicorn's
    loggers to CRITICAL, which would drop an ERROR before any handler saw it)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "quantroute")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


async def _lifespan(receive: Any, send: Any) -> None:
    while (await receive())["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def test_a_slow_body_is_a_408_in_openai_shape_and_its_connection_closes() -> None:
    async with _bounded(fake_app()) as port, _connection(port) as (reader, writer):
        with _logged() as records:
            writer.write(_post(1_000_000))  # then a byte every 0.1 s: it would take a day
            since = time.monotonic()
            trickle = asyncio.create_task(_trickle(writer))
            try:
                await _assert_408(reader, since)
            finally:
                trickle.cancel()
            await asyncio.sleep(0.1)  # the app's side of the disconnect runs
    assert not [r for r in records if r.levelno >= logging.WARNING], records
    assert any("request body took over 0.5s" in r.getMessage() for r in records)


async def test_the_app_sees_the_disconnect_and_writes_nothing_after_the_408() -> None:
    seen: list[str] = []
    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        message: dict[str, Any] = {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            seen.append(message["type"])
        # an app that answers after all: there is nobody to answer, and no bytes go out
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})
        done.set()

    async with _bounded(app) as port, _connection(port) as (reader, writer):
        with _logged() as records:
            writer.write(_post(100, b"/") + b"abc")
            since = time.monotonic()
            await writer.drain()
            await _assert_408(reader, since)  # and nothing after it: not "late"
            await asyncio.wait_for(done.wait(), WAIT_S)
    assert seen[-1] == "http.disconnect" and set(seen[:-1]) == {"http.request"}
    assert not [r for r in records if r.levelno >= logging.WARNING], records


async def test_a_body_that_arrives_in_time_is_served_even_in_slow_pieces() -> None:
    async with _bounded(fake_app()) as port, _connection(port) as (reader, writer):
        writer.write(_post(len(COMPLETION)))
        await _in_pieces(writer, COMPLETION, pieces=3, gap_s=0.1)
        status, _, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"]
        # chunked, a chunk at a time
        chunks = [b"%x\r\n%b\r\n" % (len(p), p) for p in (COMPLETION[:20], COMPLETION[20:])]
        writer.write(_CHUNKED)
        await _in_pieces(writer, b"".join([*chunks, b"0\r\n\r\n"]), pieces=3, gap_s=0.1)
        status, _, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"]
        # the served requests' clocks stopped with their bodies: the connection stays
        await asyncio.sleep(TIMEOUT_S * 2)
        writer.write(_GET)
        assert (await _response(reader))[0] == 200
        # a chunked body that stops short is timed too
        writer.write(_CHUNKED + chunks[0])
        since = time.monotonic()
        await _assert_408(reader, since)


async def test_each_request_on_a_kept_alive_connection_has_its_own_clock() -> None:
    async with _bounded(fake_app()) as port, _connection(port) as (reader, writer):
        started = time.monotonic()
        for _ in range(2):  # together longer than the clock, each within it
            writer.write(_post(len(COMPLETION)))
            await _in_pieces(writer, COMPLETION, pieces=4, gap_s=0.1)
            assert (await _response(reader))[0] == 200
        assert time.monotonic() - started > TIMEOUT_S
        # the third's clock starts at its own head, not at the connection's first
        writer.write(_post(len(COMPLETION)) + COMPLETION[:5])
        since = time.monotonic()
        await writer.drain()
        await _assert_408(reader, since)


async def test_no_clock_for_a_request_without_a_body_kept_alive_past_it() -> None:
    async with _bounded(fake_app()) as port, _connection(port) as (reader, writer):
        writer.write(_GET)
        assert (await _response(reader))[0] == 200
        writer.write(_post(len(COMPLETION)) + COMPLETION)  # its body in its head's segment
        assert (await _response(reader))[0] == 200
        await asyncio.sleep(TIMEOUT_S * 3)  # under uvicorn's keep-alive (5 s)
        writer.write(_GET)
        assert (await _response(reader))[0] == 200
        await _stalled_body_is_a_408(reader, writer)


async def test_a_response_that_started_before_the_body_came_is_cut_without_a_408() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        # answers without reading the body (as a 401 or 404 would)
        headers = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async with _bounded(app) as port, _connection(port) as (reader, writer):
        writer.write(_post(1_000_000, b"/"))
        since = time.monotonic()
        trickle = asyncio.create_task(_trickle(writer))
        try:
            assert (await _response(reader))[0] == 200
            # uvicorn's keep-alive timer restarts with every byte; the body's clock does not
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            assert time.monotonic() - since < TIMEOUT_S + MARGIN_S
        finally:
            trickle.cancel()


async def test_a_pipelined_request_is_timed_from_when_it_starts() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["path"] == "/slow":  # a response longer than the clock
            headers = [(b"content-length", b"4")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for _ in range(4):
                await asyncio.sleep(TIMEOUT_S / 2)
                await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with _bounded(app) as port, _connection(port) as (reader, writer):
        # the second request behind the first, in one segment, its body short
        writer.write(b"GET /slow HTTP/1.1\r\nhost: localhost\r\n\r\n" + _post(10, b"/") + b"abc")
        status, _, body = await _response(reader)  # whole: no 408 in the middle of it
        assert status == 200 and body == b"aaaa"
        await _assert_408(reader, time.monotonic())


def test_quantroute_serve_times_the_body() -> None:
    with serve_process(
        demo_model_dir().parent,
        "--engine-parallel", "1", "--engine-n-threads", "1", "--server-body-timeout-s", "0.5",
    ) as base:  # fmt: skip
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(_post(1_000_000) + b"{")
            since = time.monotonic()
            answer = b""
            while chunk := sock.recv(4096):  # the server closes: read to the end
                answer += chunk
            took = time.monotonic() - since
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert TIMEOUT_S - 0.05 <= took < TIMEOUT_S + MARGIN_S

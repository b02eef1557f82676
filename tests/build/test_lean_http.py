"""The serving benchmark's lean HTTP client (``benchmarks/lean_http.py``): the same lines as
httpx from the real app over a real socket; chunked bodies split anywhere; sized bodies;
``Connection: close``; a stale kept-alive connection retried once by the benchmark's
``HttpSystem``. The hand-written responses below come from a real asyncio server."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from qrtest import fake_app, live

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lean_http import Connection, ConnectionClosed  # noqa: E402
from servers import Server  # noqa: E402
from serving_systems import HttpSystem, Workload  # noqa: E402


@asynccontextmanager
async def raw_server(replies: list[list[bytes]], *, close_after: set[int]) -> AsyncIterator[int]:
    """A server answering the n-th request (over all connections) with ``replies[n]``, each
    piece its own write; it closes the connection after the requests in ``close_after``."""
    count = 0
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        writers.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            n, count = count, count + 1
            for piece in replies[n]:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
            if n in close_after:
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
        await asyncio.sleep(0.01)  # the transports' own closing callbacks


def chunked(*parts: bytes) -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in parts), b"0\r\n\r\n"]


async def test_the_same_lines_as_httpx_from_the_real_app() -> None:
    body = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 12, "stream": True}
    async with live(fake_app()) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                want = [x async for x in resp.aiter_lines() if x.startswith("data: ")]
            whole = (await client.post("/v1/completions", json=body | {"stream": False})).json()
        conn = Connection("127.0.0.1", port)
        try:
            resp2 = await conn.post("/v1/completions", json.dumps(body).encode())
            got = [x.decode() async for x in resp2.lines() if x.startswith(b"data: ")]
            again = await conn.post(
                "/v1/completions", json.dumps(body | {"stream": False}).encode()
            )  # the same kept-alive connection, a sized body
            assert again.headers["content-length"]
            whole2 = json.loads(await again.read())
        finally:
            conn.close()
    assert resp2.status == 200 and got[-1] == "data: [DONE]"
    strip = [json.loads(x[6:]) for x in got[:-1]]
    ref = [json.loads(x[6:]) for x in want[:-1]]
    texts = lambda chunks: "".join(c["choices"][0]["text"] for c in chunks if c["choices"])  # noqa: E731
    assert texts(strip) == texts(ref) and len(strip) == len(ref)
    assert whole2["choices"][0]["text"] == whole["choices"][0]["text"]


async def test_chunks_split_anywhere_give_whole_lines() -> None:
    # one event split over three chunks and two events in one; CRLF line ends too
    replies = [chunked(b'data: {"a"', b":1}\n", b"\ndata: 2\r\n\r\ndata: [DONE]\n\n")]
    async with raw_server(replies, close_after=set()) as port:
        conn = Connection("127.0.0.1", port)
        resp = await conn.post("/x", b"{}")
        lines = [line async for line in resp.lines()]
        conn.close()
    assert [x for x in lines if x] == [b'data: {"a":1}', b"data: 2", b"data: [DONE]"]


async def test_connection_close_and_a_stale_connection() -> None:
    sized = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", b"he", b"llo"]
    closing = [b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"]
    async with raw_server([sized, closing, sized], close_after={1}) as port:
        conn = Connection("127.0.0.1", port)
        first = await conn.post("/x", b"{}")
        assert first.status == 200 and await first.read() == b"hello"
        second = await conn.post("/x", b"{}")  # kept alive: the same connection
        assert await second.read() == b"ok" and conn.writer is None  # the server said close
        third = await conn.post("/x", b"{}")  # a fresh connection, made on demand
        assert await third.read() == b"hello"
        conn.close()


async def test_a_stale_kept_alive_connection_is_retried_once(tmp_path: Path) -> None:
    done = chunked(
        b'data: {"choices":[{"text":"hi","finish_reason":null}]}\n\n',
        b'data: {"choices":[{"text":"","finish_reason":"length"}],'
        b'"usage":{"completion_tokens":1}}\n\n',
        b"data: [DONE]\n\n",
    )
    # the first stream's connection is closed by the server once it ends (as an idle
    # timeout would): the next request on it gets no response, and is sent again
    async with raw_server([done, done], close_after={0}) as port:
        server = Server("raw", [], port, "/", tmp_path / "log")
        system = HttpSystem(server, {}, 1)
        await system.open()
        work = Workload("m", "p", 1, 0, False)
        a = await system.stream(work)
        await asyncio.sleep(0.05)  # the server's close arrives
        b = await system.stream(work)
        await system.close()
    assert a.error is None and a.tokens == 1 and a.text == ["hi"]
    assert b.error is None and b.tokens == 1 and system.retries == 1


async def test_an_error_status_and_a_broken_body(tmp_path: Path) -> None:
    bad = [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"]
    cut = [*chunked(b'data: {"choices":[]}\n\n')[:-1]]  # no last chunk: the server closes
    async with raw_server([bad, cut], close_after={1}) as port:
        system = HttpSystem(Server("raw", [], port, "/", tmp_path / "log"), {}, 1)
        await system.open()
        work = Workload("m", "p", 1, 0, False)
        first = await system.stream(work)
        second = await system.stream(work)
        await system.close()
    assert first.error is not None and first.error.startswith("HTTP 503")
    assert second.error is not None and "closed inside a chunked body" in second.error


async def test_not_http_is_an_error() -> None:
    async with raw_server([[b"SSH-2.0-nope\r\n"]], close_after={0}) as port:
        conn = Connection("127.0.0.1", port)
        with pytest.raises(ConnectionError, match="not an HTTP response") as info:
            await conn.post("/x", b"{}")
        assert not isinstance(info.value, ConnectionClosed)

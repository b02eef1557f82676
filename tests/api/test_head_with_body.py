"""A response's head goes out with its first body, in one segment (``app.HeadWithBody``):
the socket is corked from the head to the first body (on a real TCP socket), uncorked
after it however the app ends, and left alone where the server's send is not known."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys

import pytest

from qrtest import fake_app, live
from quantroute.api.app import HeadWithBody


def _request(body: dict[str, object]) -> bytes:
    raw = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


async def _read_response(reader: asyncio.StreamReader, data: bytes) -> bytes:
    """The rest of a chunked response that began with ``data`` (it ends with the last
    chunk's ``0``)."""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        more = await asyncio.wait_for(reader.read(65536), 10)
        assert more, "the server closed the connection"
        data += more
    return data


class _Cycle:
    """Stands for uvicorn's request cycle: ``send`` is its bound method, and it has the
    connection's transport (here a real, connected TCP socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.transport = self
        self.sock = sock
        self.corked: list[tuple[str, int]] = []  # TCP_CORK as each message was written

    def get_extra_info(self, name: str) -> socket.socket:
        assert name == "socket"
        return self.sock

    async def send(self, message: dict[str, object]) -> None:
        state = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)
        self.corked.append((str(message["type"]).rpartition(".")[2], state))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CORK is Linux's")
@pytest.mark.parametrize("bodies", [1, 3])
async def test_the_head_is_held_until_the_first_body_is_written(bodies: int) -> None:
    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        for i in range(bodies):
            more = i < bodies - 1
            await send({"type": "http.response.body", "body": b"x", "more_body": more})  # type: ignore[operator]

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            cycle = _Cycle(conn)
            await HeadWithBody(app)({"type": "http"}, None, cycle.send)  # type: ignore[arg-type]
            # corked for the head and the first body, open for the rest and after
            assert cycle.corked == [("start", 1), ("body", 1)] + [("body", 0)] * (bodies - 1)
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CORK is Linux's")
async def test_an_app_that_fails_after_the_head_leaves_the_socket_uncorked() -> None:
    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        raise RuntimeError("a bug")

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            with pytest.raises(RuntimeError):
                await HeadWithBody(app)({"type": "http"}, None, _Cycle(conn).send)  # type: ignore[arg-type]
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0


async def test_a_stream_under_uvicorn_arrives_whole_and_its_connection_serves_again() -> None:
    async with live(fake_app()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(2):  # the second on the same connection
                body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "stream": True}
                writer.write(_request(body))
                first = await asyncio.wait_for(reader.read(65536), 10)
                assert first.startswith(b"HTTP/1.1 200")
                whole = await _read_response(reader, first)
                events = re.findall(rb"^data: (.*?)\r?$", whole, re.MULTILINE)
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                assert len(text) == 4 and events[-1] == b"[DONE]"  # every token, then the end
        finally:
            writer.close()


async def test_without_the_servers_send_every_message_passes_as_it_is() -> None:
    seen: list[dict[str, object]] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"x"})  # type: ignore[operator]

    async def send(message: dict[str, object]) -> None:  # a plain function: no transport
        seen.append(message)

    await HeadWithBody(app)({"type": "http"}, None, send)  # type: ignore[arg-type]
    assert [m["type"] for m in seen] == ["http.response.start", "http.response.body"]

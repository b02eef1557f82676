"""The bounded request head (``api/protocol.py``) over real sockets: uvicorn with the
protocol ``quantroute serve`` runs, in this event loop, and ``quantroute serve`` itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

import httpx

from qrtest import demo_model_dir, fake_app, fake_table, live, serve_process
from quantroute.api.app import create_app
from quantroute.api.protocol import bounded
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

TIMEOUT_S = 0.5


def _bounded(app: object, max_head_bytes: int = 8192) -> Any:
    return live(app, http=bounded(max_head_bytes, TIMEOUT_S))  # type: ignore[arg-type]


async def _exchange(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # the server closes: read to the end
    writer.close()
    return answer


def _status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_a_head_over_the_limit_is_a_431_in_openai_shape() -> None:
    async with _bounded(fake_app()) as port:
        for head in (
            b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * 9000 + b"\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(2000)),
            b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nhost: a\r\n\r\n",
        ):
            status, body = _status_and_body(await _exchange(port, head))
            assert status == 431
            error = json.loads(body)["error"]
            assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
        # one under the limit is served, on a connection that stays open for the next
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for _ in range(2):
                r = await http.get("/healthz", headers={"x-big": "a" * 6000})
                assert r.status_code == 200


async def test_a_request_that_is_not_http_is_a_400_in_openai_shape() -> None:
    """What httptools cannot parse was uvicorn's plain-text 400."""
    async with _bounded(fake_app()) as port:
        for head in (
            b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-nul: a\x00b\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: "
            + b"9" * 23
            + b"\r\n\r\n",
            b"NOT HTTP AT ALL\r\n\r\n",
        ):
            answer = await _exchange(port, head)
            status, body = _status_and_body(answer)
            assert status == 400 and b"content-type: application/json" in answer
            assert json.loads(body) == {
                "error": {
                    "message": "the request is not valid HTTP/1.1",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_http",
                }
            }
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/healthz")).status_code == 200  # and it serves on


async def test_a_head_sent_too_slowly_loses_its_connection_and_a_long_answer_does_not() -> None:
    slow = {"f16": FakeEngine(token_delay_s=0.1)}
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"})
    async with _bounded(create_app(settings, table=fake_table(slow))) as port:
        # slowloris: the request line, then a header a byte at a time
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(10)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            started = time.monotonic()
            closed = False
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for byte in b"x-slow: " + b"a" * 100:
                    sock.sendall(bytes([byte]))
                    await asyncio.sleep(0.05)
                    if time.monotonic() - started > 3:
                        break
            closed = sock.recv(1024) == b""
            assert closed and time.monotonic() - started < 3
        # a connection that says nothing at all goes too
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(10)
            await asyncio.sleep(TIMEOUT_S * 2)
            assert sock.recv(1024) == b""
        # the head's clock stops at the head: a stream longer than it is answered whole
        body = {"model": "tiny-llama:f16", "prompt": "x", "max_tokens": 12, "stream": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            started = time.monotonic()
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            assert time.monotonic() - started > TIMEOUT_S * 2


def test_quantroute_serve_bounds_the_head() -> None:
    with serve_process(
        demo_model_dir().parent,
        "--engine-parallel", "1", "--engine-n-threads", "1", "--server-max-header-bytes", "4096",
    ) as base:  # fmt: skip
        assert httpx.get(f"{base}/healthz", headers={"x-a": "a" * 3000}).status_code == 200
        r = httpx.get(f"{base}/healthz", headers={"x-a": "a" * 5000})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"

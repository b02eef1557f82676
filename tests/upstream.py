"""A fake OpenAI-compatible upstream, for the remote engine's faults that a real server
will not produce on demand: a stall before the first token, a 500, a malformed event, an
event larger than any bound, a connection dropped mid-stream, a 400 with OpenAI's error
body. Everything else is tested against real servers (llama-server, quantroute).

It is a raw HTTP/1.1 server on asyncio (keep-alive, chunked responses), so that each
behaviour controls every byte and moment, and it records each generation request it takes
(:class:`Call`): its body and headers, how many bytes it sent, and when the client's side
of the connection went away, seen from here (``Call.gone``).

A request's ``model`` picks its behaviour (:data:`BEHAVIOURS`, or
``FakeUpstream.behaviours``): a manifest's ``remote_model`` names the fault a branch has.
``GET /health`` answers 200 while ``healthy`` is set (else 503; a 404 without
``has_health``); ``GET /metrics`` answers ``metrics`` (404 while it is ``None``);
``GET /v1/models`` lists the behaviours.

Run it in the test's event loop (``async with FakeUpstream() as up``) or in a thread of
its own for a test that drives a server process synchronously (``with upstream_thread()
as up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BEHAVIOURS", "TEXT", "Call", "Exchange", "FakeUpstream", "upstream_thread"]

TEXT = ("Hello", " from", " upstream")  # what ``ok`` streams, one token a chunk
USAGE = {"prompt_tokens": 7, "completion_tokens": len(TEXT), "total_tokens": 7 + len(TEXT)}
ERROR_400 = {
    "error": {
        "message": "This model's maximum context length is 8 tokens; you asked for 90.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}


@dataclass
class Call:
    """One generation request the upstream took."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # lower-case names
    opened: float = field(default_factory=time.monotonic)
    closed: float | None = None  # when the client's side went away (monotonic), if it did
    sent: int = 0  # bytes of the response body written (before chunk framing)
    gone: threading.Event = field(default_factory=threading.Event)

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))

    def went_away(self) -> None:
        if self.closed is None:
            self.closed = time.monotonic()
            self.gone.set()


class Exchange:
    """One request's response, written by a behaviour."""

    def __init__(self, call: Call, writer: asyncio.StreamWriter, closed: asyncio.Event):
        self.call = call
        self.chat = call.path.endswith("/chat/completions")
        self._writer = writer
        self._closed = closed
        self._chunked = False
        self.keep_alive = True

    async def _write(self, data: bytes) -> None:
        if self._closed.is_set():
            raise ConnectionResetError("the client went away")
        self._writer.write(data)
        await self._writer.drain()

    async def head(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        """The status line and headers of a chunked response."""
        self._chunked = True
        await self._write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n"
            "transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n".encode()
        )

    async def send(self, data: bytes) -> None:
        """``data`` as one chunk of the body."""
        if data:
            await self._write(b"%x\r\n%s\r\n" % (len(data), data))
            self.call.sent += len(data)

    async def event(self, obj: object) -> None:
        await self.send(b"data: " + json.dumps(obj).encode() + b"\n\n")

    async def token(self, text: str, finish: str | None = None) -> None:
        """A chunk adding ``text``, shaped for the endpoint asked."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice["finish_reason"] = finish
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        await self.event({"id": "up-1", "object": kind, "model": self.call.model,
                          "choices": [choice]})  # fmt: skip

    async def finish(self, reason: str = "stop", usage: dict[str, int] | None = None) -> None:
        """The last chunk, the usage chunk, ``[DONE]`` and the end of the body."""
        await self.token("", reason)
        await self.event({"id": "up-1", "choices": [], "usage": usage or USAGE})
        await self.send(b"data: [DONE]\n\n")
        await self.end()

    async def end(self) -> None:
        await self._write(b"0\r\n\r\n")

    async def json(self, status: int, obj: object) -> None:
        """A whole JSON response."""
        body = json.dumps(obj).encode()
        await self._write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.call.sent += len(body)

    def abort(self) -> None:
        """Drop the connection where it stands (an RST, no end of the chunked body)."""
        self.keep_alive = False
        self._writer.transport.abort()

    async def until_gone(self, limit_s: float = 60.0) -> None:
        """Wait for the client to go away (at most ``limit_s``)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), limit_s)


Behaviour = Callable[[Exchange], Awaitable[None]]


async def ok(ex: Exchange) -> None:
    """A healthy stream: :data:`TEXT`, one token a chunk, then usage and ``[DONE]``."""
    await ex.head()
    for text in TEXT:
        await ex.token(text)
    await ex.finish()


async def stall(ex: Exchange) -> None:
    """Nothing at all, not even headers, until the client leaves."""
    await ex.until_gone()


async def stall_after_head(ex: Exchange) -> None:
    """A 200 and its headers, then nothing until the client leaves."""
    await ex.head()
    await ex.until_gone()


async def http500(ex: Exchange) -> None:
    await ex.json(500, {"error": {"message": "internal error", "type": "server_error"}})


async def http400(ex: Exchange) -> None:
    """OpenAI's own error body for a request too long for the model."""
    await ex.json(400, ERROR_400)


async def http401(ex: Exchange) -> None:
    await ex.json(401, {"error": {"message": "bad key", "type": "invalid_request_error"}})


async def http429(ex: Exchange) -> None:
    await ex.json(429, {"error": {"message": "slow down", "type": "rate_limit_error"}})


async def bad_json(ex: Exchange) -> None:
    """A first token, then an event that is not JSON, then the stream stays open."""
    await ex.head()
    await ex.token(TEXT[0])
    await ex.send(b'data: {"choices": [{"delta": {"content": "x"\n\n')
    await ex.until_gone()


async def bad_json_first(ex: Exchange) -> None:
    """An event that is not JSON before any token."""
    await ex.head()
    await ex.send(b"data: {not json\n\n")
    await ex.until_gone()


async def error_event(ex: Exchange) -> None:
    """A first token, then an error object mid-stream (vLLM's way to fail a stream)."""
    await ex.head()
    await ex.token(TEXT[0])
    await ex.event({"error": {"message": "engine died", "type": "server_error", "code": 500}})
    await ex.until_gone()


HUGE_BYTES = 256 << 20  # what ``huge`` offers: far more than any event bound
_PIECE = b"x" * (64 << 10)


async def huge(ex: Exchange) -> None:
    """A first token, then one event that never ends: up to :data:`HUGE_BYTES` of data
    on one line, written as the client reads it (so ``Call.sent`` says how much it took)."""
    await ex.head()
    await ex.token(TEXT[0])
    await _endless_line(ex)


async def huge_first(ex: Exchange) -> None:
    """The same endless event, before any token."""
    await ex.head()
    await _endless_line(ex)


async def _endless_line(ex: Exchange) -> None:
    with contextlib.suppress(ConnectionError):
        await ex.send(b'data: {"choices": [{"delta": {"content": "')
        while ex.call.sent < HUGE_BYTES:
            await ex.send(_PIECE)
    await ex.until_gone(5.0)


async def drop(ex: Exchange) -> None:
    """Two tokens, then the connection is dropped mid-body."""
    await ex.head()
    await ex.token(TEXT[0])
    await ex.token(TEXT[1])
    await asyncio.sleep(0.05)
    ex.abort()


async def drop_first(ex: Exchange) -> None:
    """A 200's headers, then the connection is dropped before any token."""
    await ex.head()
    ex.abort()


async def end_early(ex: Exchange) -> None:
    """A 200 whose body ends cleanly with neither a token nor ``[DONE]``."""
    await ex.head()
    await ex.end()


async def truncated(ex: Exchange) -> None:
    """Two tokens, then the body ends cleanly: no finish reason, no usage, no ``[DONE]``
    (what a proxy that cut the stream short would send)."""
    await ex.head()
    await ex.token(TEXT[0])
    await ex.token(TEXT[1])
    await ex.end()


async def slow(ex: Exchange) -> None:
    """A token every 50 ms, up to 1200 (a minute), while the client reads."""
    await ex.head()
    with contextlib.suppress(ConnectionError):
        for i in range(1200):
            await ex.token(f" t{i}")
            await asyncio.sleep(0.05)
        await ex.finish("length")
    await ex.until_gone(5.0)


async def data_lines(ex: Exchange) -> None:
    """A first token, then one event of 10,000 one-byte data lines (70 kB), then its end."""
    await ex.head()
    await ex.token(TEXT[0])
    with contextlib.suppress(ConnectionError):
        await ex.send(b"data: x\n" * 10_000 + b"\n")
        await ex.finish()
    await ex.until_gone(5.0)


async def deep_json(ex: Exchange) -> None:
    """A first token, then an event of 100,000 nested arrays (valid JSON, 200 kB)."""
    await ex.head()
    await ex.token(TEXT[0])
    await ex.send(b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n")
    await ex.until_gone(5.0)


async def odd_logprobs(ex: Exchange) -> None:
    """A first token, then one whose ``logprobs`` has a number where a list belongs."""
    await ex.head()
    await ex.token(TEXT[0])
    choice = {"index": 0, "text": "x", "delta": {"content": "x"}, "logprobs": {"tokens": 3}}
    await ex.event({"choices": [choice]})
    await ex.finish()


async def with_logprobs(ex: Exchange) -> None:
    """:data:`TEXT` with a logprob and two alternatives per token (chat's shape, which
    llama-server also sends for completions)."""
    await ex.head()
    for i, text in enumerate(TEXT):
        entry = {"token": text, "id": 100 + i, "logprob": -0.5 * i, "top_logprobs": [
            {"token": text, "id": 100 + i, "logprob": -0.5 * i},
            {"token": "?", "id": 7, "logprob": -9.0}]}  # fmt: skip
        choice: dict[str, Any] = {"index": 0, "finish_reason": None,
                                  "logprobs": {"content": [entry]}}  # fmt: skip
        if ex.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        await ex.event({"choices": [choice]})
    await ex.finish("length")


async def echo(ex: Exchange) -> None:
    """The request's body back as the text, in one token (what was sent upstream)."""
    await ex.head()
    await ex.token(json.dumps(ex.call.body, sort_keys=True))
    await ex.finish()


BEHAVIOURS: dict[str, Behaviour] = {
    "ok": ok,
    "stall": stall,
    "stall-after-head": stall_after_head,
    "http500": http500,
    "http400": http400,
    "http401": http401,
    "http429": http429,
    "bad-json": bad_json,
    "bad-json-first": bad_json_first,
    "error-event": error_event,
    "huge": huge,
    "huge-first": huge_first,
    "drop": drop,
    "drop-first": drop_first,
    "end-early": end_early,
    "truncated": truncated,
    "slow": slow,
    "echo": echo,
    "data-lines": data_lines,
    "deep-json": deep_json,
    "odd-logprobs": odd_logprobs,
    "logprobs": with_logprobs,
}


class FakeUpstream:
    """The server (see the module's text): ``port`` once started; ``calls`` it took."""

    def __init__(self, behaviours: dict[str, Behaviour] | None = None):
        self.behaviours = dict(BEHAVIOURS if behaviours is None else behaviours)
        self.healthy = True
        self.has_health = True  # False: /health is a 404 (probes fall back to /v1/models)
        self.metrics: str | None = None
        self.calls: list[Call] = []
        self.probes: list[str] = []  # the paths of GETs taken
        self.port = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def calls_of(self, model: str) -> list[Call]:
        return [c for c in self.calls if c.model == model]

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            await self._server.wait_closed()
            if self._handlers:
                await asyncio.wait(self._handlers, timeout=10)
            self._server = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        prefix = b""
        try:
            while True:
                try:
                    head = prefix + await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name:
                        headers[name.strip().lower()] = value.strip()
                size = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(size) if size else b""
                if method == "GET":
                    await self._get(path, writer)
                    prefix = b""
                    continue
                prefix, keep = await self._generate(path, raw, headers, reader, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.discard(writer)
            self._handlers.discard(task)
            writer.transport.abort()

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> None:
        self.probes.append(path)
        if path == "/health" and self.has_health:
            status, body, kind = (200 if self.healthy else 503), b'{"status":"ok"}', "json"
        elif path == "/metrics" and self.metrics is not None:
            status, body, kind = 200, self.metrics.encode(), "plain"
        elif path == "/v1/models" and self.healthy:
            data = [{"id": name, "object": "model"} for name in self.behaviours]
            status, body, kind = 200, json.dumps({"object": "list", "data": data}).encode(), "json"
        else:
            status, body, kind = 404, b'{"error": {"message": "not found"}}', "json"
        ctype = "application/json" if kind == "json" else "text/plain; version=0.0.4"
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _generate(
        self,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> tuple[bytes, bool]:
        """Run the behaviour the body's model names; the bytes the watcher read of the
        next request, and whether the connection is still usable."""
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        call = Call(path, body if isinstance(body, dict) else {}, headers)
        self.calls.append(call)
        closed = asyncio.Event()
        ex = Exchange(call, writer, closed)
        watcher = asyncio.ensure_future(reader.read(1))

        def watched(done: asyncio.Future[bytes]) -> None:
            if done.cancelled() or done.exception() is not None or not done.result():
                closed.set()
                call.went_away()

        watcher.add_done_callback(watched)
        behaviour = self.behaviours.get(call.model)
        try:
            if behaviour is None:
                await ex.json(404, {"error": {"message": f"no model {call.model}"}})
            else:
                await behaviour(ex)
        except ConnectionError:
            closed.set()
            call.went_away()
        if not watcher.done():
            watcher.remove_done_callback(watched)
            watcher.cancel()
            return b"", ex.keep_alive and not closed.is_set()
        if closed.is_set():
            return b"", False
        return watcher.result(), ex.keep_alive


@contextlib.contextmanager
def upstream_thread(behaviours: dict[str, Behaviour] | None = None) -> Iterator[FakeUpstream]:
    """A :class:`FakeUpstream` on an event loop in a thread of its own (for tests that
    drive a server process synchronously); stopped at the end."""
    up = FakeUpstream(behaviours)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(up.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="fake-upstream", daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield up
    finally:
        asyncio.run_coroutine_threadsafe(up.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

"""A lean HTTP/1.1 client for the serving benchmark's streams: asyncio streams, one kept-alive
connection per client, chunked or sized bodies, the lines of an event stream as they arrive.

The benchmark's client shares the machine with the servers it measures (on 2 cores: the
client, the gateway and the worker). httpx over h11 spends about 240 µs of CPU per streamed
chunk here; this reader spends a fraction of that, so more of the machine is left to the
servers, the same for all of them. It speaks only what the benchmark needs: ``POST`` with a
JSON body, a status line, headers, ``Transfer-Encoding: chunked`` or ``Content-Length``, and
``Connection: close``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

MAX_HEADER_BYTES = 64 * 1024


class ConnectionClosed(ConnectionError):
    """The server closed the connection before a response began (a stale kept-alive one)."""


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    _conn: Connection = field(repr=False)
    _chunked: bool = False
    _left: int | None = None  # body bytes still to come (sized bodies); None: until close
    _done: bool = False
    _close_after: bool = False  # ``Connection: close``: the connection ends with this body

    async def body_parts(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, de-chunked."""
        reader = self._conn.reader
        if self._chunked:
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ConnectionError("the connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await reader.read(min(self._left, 65536))
                if not data:
                    raise ConnectionError("the connection closed inside a sized body")
                self._left -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                yield data
            self._conn.close()
        self._done = True
        if self._close_after:
            self._conn.close()

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without their ending), as an event stream reader splits them."""
        pending = b""
        async for part in self.body_parts():
            pending += part
            if b"\n" not in pending:
                continue
            *whole, pending = pending.split(b"\n")
            for line in whole:
                yield line[:-1] if line.endswith(b"\r") else line
        if pending:
            yield pending

    async def read(self) -> bytes:
        return b"".join([part async for part in self.body_parts()])


class Connection:
    """One kept-alive connection; requests on it run one after another."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter | None = None
        self._last: Response | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def post(self, path: str, body: bytes) -> Response:
        """Send ``POST path`` with a JSON body and read the status line and headers. A reused
        connection the server had closed raises :class:`ConnectionClosed`."""
        if self._last is not None and not self._last._done:
            self.close()  # the last body was not read to its end: this connection is spent
        reused = self.writer is not None
        if self.writer is None:
            await self._connect()
        assert self.writer is not None
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "accept: text/event-stream\r\n\r\n"
        ).encode()
        try:
            self.writer.write(head + body)
            await self.writer.drain()
            status_line = await self.reader.readline()
        except ConnectionError as exc:
            self.close()
            if reused:
                raise ConnectionClosed(str(exc)) from exc
            raise
        if not status_line:
            self.close()
            raise ConnectionClosed("the server closed the connection without a response")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            self.close()
            raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        size = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n"):
            size += len(line)
            if not line or size > MAX_HEADER_BYTES:
                self.close()
                raise ConnectionError("the response's headers did not end")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        response = Response(
            int(parts[1]),
            headers,
            self,
            _chunked=chunked,
            _left=None if chunked or length is None else int(length),
        )
        response._close_after = headers.get("connection", "").lower() == "close"
        self._last = response
        return response

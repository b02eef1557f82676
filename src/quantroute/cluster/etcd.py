"""etcd v3 through its JSON gateway over httpx: a prefix's keys, writes, and a watch.

etcd serves its gRPC API as JSON too (grpc-gateway, on the client port): ``POST
/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange`` and ``/v3/watch``, a stream of
JSON lines; keys and values travel base64-encoded, 64-bit numbers as strings. The
gateway already depends on httpx, and this is all of etcd a gateway needs, so there is
no etcd package to install (docs/cluster.md says why not ``aetcd`` or ``etcd3gw``).

Endpoints are tried in turn: a request that cannot reach one, or that one answers with
a server error, goes to the next; the one that answered is tried first next time.
Every failure to reach etcd is :class:`EtcdUnavailable`; a watch whose start revision
was compacted away is :class:`EtcdCompacted` (read everything again, then watch on).

>>> prefix_end(b"/quantroute/")
b'/quantroute0'
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

__all__ = [
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "KeyValue",
    "Snapshot",
    "WatchBatch",
    "prefix_end",
]

MAX_WATCH_LINE_BYTES = 16 << 20  # one watch message; etcd's own request limit is 1.5 MiB


class EtcdError(Exception):
    """etcd refused a request (a value too large, say): retrying will not help."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time, or every one answered with a server error."""


class EtcdCompacted(EtcdError):
    """The revision a watch was to start from is compacted: read the keys again."""

    def __init__(self, compact_revision: int):
        super().__init__(f"revision compacted (etcd keeps revisions from {compact_revision})")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int  # the revision that last wrote it


@dataclass(frozen=True, slots=True)
class Event:
    """A key written (``value``) or deleted (``value is None``) at ``mod_revision``."""

    key: str
    value: bytes | None
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every key under a prefix as of ``revision``: a watch from ``revision + 1`` misses
    nothing and repeats nothing."""

    items: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """The events of one watch message (one or more revisions, in order)."""

    events: tuple[Event, ...]
    revision: int  # the store's revision when etcd sent them


def prefix_end(prefix: bytes) -> bytes:
    """The first key past every key that starts with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _revision(message: dict[str, Any]) -> int:
    return int(message.get("header", {}).get("revision", 0))


class EtcdClient:
    """The few etcd calls a gateway makes, over one pool of HTTP connections (and one
    more connection per watch). ``transport`` is for tests."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        self._at = 0  # the endpoint that answered last
        self._timeout_s = timeout_s
        common: dict[str, Any] = {
            "trust_env": False,  # no proxy or netrc from the environment: etcd is internal
            "follow_redirects": False,
            "transport": transport,
        }
        self._http = httpx.AsyncClient(timeout=timeout_s, **common)
        # a watch is quiet for as long as nothing changes: no read timeout
        watch_timeout = httpx.Timeout(timeout_s, read=None)
        self._watch_http = httpx.AsyncClient(timeout=watch_timeout, **common)

    @property
    def endpoint(self) -> str:
        """The endpoint tried first now."""
        return self.endpoints[self._at]

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._watch_http.aclose()

    # -- unary calls ------------------------------------------------------------

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers."""
        last = "no endpoint"
        for _ in range(len(self.endpoints)):
            url = self.endpoint + path
            try:
                response = await self._http.post(url, json=body)
            except httpx.HTTPError as exc:
                last = f"{self.endpoint}: {type(exc).__name__}: {exc}".rstrip(": ")
            else:
                if response.status_code < 500:
                    message = _json(response.content)
                    if response.status_code != 200:
                        raise EtcdError(f"{path}: {_error_text(message)}")
                    return message
                last = f"{self.endpoint}: HTTP {response.status_code}"
            self._next()
        raise EtcdUnavailable(last)

    async def range_prefix(self, prefix: str) -> Snapshot:
        """Every key under ``prefix`` and the revision they are as of (one read)."""
        raw = prefix.encode()
        message = await self._call(
            "/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_end(raw))}
        )
        items = tuple(
            KeyValue(
                _unb64(kv.get("key")).decode(), _unb64(kv.get("value")), int(kv["mod_revision"])
            )
            for kv in message.get("kvs", ())
        )
        return Snapshot(items, _revision(message))

    async def put(self, key: str, value: bytes) -> int:
        """Write ``key``; the revision of the write."""
        message = await self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
        return _revision(message)

    async def delete(self, key: str) -> int:
        """Delete ``key`` (whether or not it exists); the store's revision after it."""
        return _revision(await self._call("/v3/kv/deleterange", {"key": _b64(key)}))

    async def revision(self) -> int:
        """The store's revision: a cheap call that says etcd answers (a count of nothing)."""
        message = await self._call("/v3/kv/range", {"key": _b64("\0"), "count_only": True})
        return _revision(message)

    # -- watch ------------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchBatch]:
        """Every change under ``prefix`` from ``start_revision`` on, one message at a time,
        for as long as the connection lasts. Raises :class:`EtcdCompacted` when etcd no
        longer has ``start_revision``, :class:`EtcdUnavailable` when the stream breaks."""
        raw = prefix.encode()
        create = {
            "key": _b64(raw),
            "range_end": _b64(prefix_end(raw)),
            "start_revision": str(start_revision),
        }
        url = self.endpoint + "/v3/watch"
        try:
            async with self._watch_http.stream(
                "POST", url, json={"create_request": create}
            ) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"{url}: HTTP {response.status_code}")
                async for line in _lines(response):
                    batch = _watch_message(_json(line))
                    if batch is not None:
                        yield batch
        except httpx.HTTPError as exc:
            self._next()
            raise EtcdUnavailable(f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
        except EtcdUnavailable:
            self._next()
            raise
        self._next()
        raise EtcdUnavailable(f"{url}: the watch stream ended")

    def _next(self) -> None:
        """Try the next endpoint first from now on."""
        self._at = (self._at + 1) % len(self.endpoints)


async def _lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's lines (one JSON message each), each at most ``MAX_WATCH_LINE_BYTES``."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        while (cut := pending.find(b"\n")) >= 0:
            line, pending = pending[:cut], pending[cut + 1 :]
            if line.strip():
                yield line
        if len(pending) > MAX_WATCH_LINE_BYTES:
            raise EtcdUnavailable("a watch message over the size limit")
    if pending.strip():
        yield pending


def _watch_message(message: dict[str, Any]) -> WatchBatch | None:
    """One watch message: its events, ``None`` for one without (created, progress), or
    the error it carries."""
    if "error" in message:
        raise EtcdUnavailable(f"watch: {_error_text(message)}")
    result = message.get("result", {})
    compacted = int(result.get("compact_revision", 0))
    if compacted:
        raise EtcdCompacted(compacted)
    if result.get("canceled"):
        raise EtcdUnavailable(f"watch canceled: {result.get('cancel_reason') or 'no reason'}")
    events = tuple(
        Event(
            _unb64(e["kv"].get("key")).decode(),
            None if e.get("type") == "DELETE" else _unb64(e["kv"].get("value")),
            int(e["kv"].get("mod_revision", 0)),
        )
        for e in result.get("events", ())
    )
    return WatchBatch(events, _revision(result)) if events else None


def _json(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise EtcdUnavailable("etcd answered something that is not JSON") from exc
    if not isinstance(message, dict):
        raise EtcdUnavailable("etcd answered something that is not a JSON object")
    return message


def _error_text(message: dict[str, Any]) -> str:
    error = message.get("error")
    if isinstance(error, dict):  # a watch stream's error
        return str(error.get("message") or error.get("http_status") or error)
    return str(message.get("message") or error or "error")

"""Reading another gateway's stream from its copy in Redis (``cluster/redis_streams.py``
writes the copies): what ``StreamStore.find`` resumes when the stream is not its own.

A resume is one pipelined round trip (:meth:`CopyReader.lookup`): the copy's meta (its
owner and token digest, which the store checks as it checks its own streams), its
entries from the first event wanted on, and its last entry (where it ends, or has got
to). The rest comes by ``XREAD BLOCK`` (a connection of ``RedisLink.reader`` while it
waits) as the producing gateway copies it. A read that waits ``read_block_s`` for nothing
looks at the producer's heartbeat (``P:gateway:<id>``): gone, with no end in the copy, a
last look takes what it sent before it went, and the resume ends with a
``stream_producer_lost`` error event. A gap in the copy (events its gateway could not
copy in time) ends it with ``stream_events_lost``, a copy that vanished too (its keys
expired, or Redis restarted empty), and a Redis that stops answering for
``heartbeat_ttl_s`` with ``stream_store_unreachable``: never a silent end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from quantroute.cluster.redis_link import FAILURES, RedisLink
from quantroute.config import StreamSettings
from quantroute.errors import QuantrouteError, ServiceUnavailableError
from quantroute.resilience.resume import RemoteCopy

__all__ = ["LOST", "PRODUCER_LOST", "UNREACHABLE", "CopyReader"]

READ_COUNT = 128  # entries per read


def _payload(code: str, message: str) -> bytes:
    error = QuantrouteError(message, code=code)
    return json.dumps(error.to_openai(), separators=(",", ":")).encode()


PRODUCER_LOST = _payload(
    "stream_producer_lost",
    "the gateway producing this stream stopped before its end: these are all the events "
    "it produced",
)
LOST = _payload(
    "stream_events_lost",
    "the rest of this stream was not copied to the fleet's store (Redis was slow or "
    "down); only the gateway that produced it has it",
)
UNREACHABLE = _payload("stream_store_unreachable", "the fleet's stream store stopped answering")


class CopyReader:
    """Reads the copies of other gateways' streams; see the module docstring."""

    def __init__(self, link: RedisLink, settings: StreamSettings):
        self._link = link
        self._settings = settings

    async def lookup(self, key: str, after: int | None) -> RemoteCopy | None:
        """The copy of the stream ``key`` from the event after ``after`` on (at most the
        events a stream may run ahead of its reader, then ``rest``); ``None``: none."""
        start = 0 if after is None else after + 1
        link = self._link
        skey, mkey = link.keys.stream(key), link.keys.stream_meta(key)
        pipe = link.client.pipeline(transaction=False)
        pipe.get(mkey)
        pipe.xrange(skey, min=f"0-{start + 1}", max="+", count=READ_COUNT)
        pipe.xrevrange(skey, max="+", min="-", count=1)
        try:
            async with asyncio.timeout(link.timings.command_timeout_s):
                meta, entries, last = await pipe.execute()
        except FAILURES as exc:
            link.failed(exc, "stream lookup")
            raise ServiceUnavailableError(
                "the fleet's stream store is unreachable", retry_after_s=1.0
            ) from exc
        if not meta:
            return None
        m = json.loads(meta)
        cap = self._settings.max_events_per_stream
        cap -= cap // 8  # what a stream may run ahead of its reader
        read = _Read(start, first=True)
        for entry_id, fields in entries:
            done = read.take(fields)
            read.last_id = entry_id
            if done or len(read.events) >= cap:
                break
        next_seq = _end_of(last[0][1]) if last else 0
        if last and not read.done and b"d" not in last[0][1]:  # past the copy's last mark
            read.done = True
            if b"x" in last[0][1]:  # the copy lost what the resume wants
                read.kept_from = start + 1
        rest = None
        if not read.done:
            rest = self._follow(key, m.get("gateway", ""), read.seq, read.last_id)
        return RemoteCopy(
            owner=m.get("owner", ""),
            token_digest=m.get("token", ""),
            headers={str(k): str(v) for k, v in m.get("headers", {}).items()},
            kept_from=read.kept_from,
            events=read.events,
            next_seq=max(next_seq, read.seq) if read.events else next_seq,
            rest=rest,
        )

    async def _follow(
        self, key: str, gateway: str, seq: int, last_id: bytes | str
    ) -> AsyncIterator[list[bytes]]:
        """The copy's events from ``seq`` on (the entries after ``last_id``), as they come,
        until its end, or an error event where it cannot say more."""
        link = self._link
        t = link.timings
        skey = link.keys.stream(key)
        read = _Read(seq, first=False)
        read.last_id = last_id
        failing_since: float | None = None
        block_ms: int | None = int(t.read_block_s * 1000)
        while True:
            try:
                reply = await link.reader.xread(
                    {skey: read.last_id}, count=READ_COUNT, block=block_ms
                )
            except FAILURES as exc:
                link.failed(exc, "stream read")
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= t.heartbeat_ttl_s:
                    yield [UNREACHABLE]
                    return
                await asyncio.sleep(t.heartbeat_s)
                continue
            failing_since = None
            entries = _entries(reply)
            if not entries and block_ms is None:  # the last look: its producer is gone
                yield [PRODUCER_LOST]
                return
            if not entries:
                block_ms = await self._still_produced(gateway, skey)
                if block_ms == -1:
                    yield [LOST]  # expired, or Redis lost it (a restart)
                    return
                continue
            for entry_id, fields in entries:
                done = read.take(fields)
                read.last_id = entry_id
                if done:
                    break
            if read.events:
                yield read.events
                read.events = []
            if read.done:
                return
            if block_ms is None:  # what the producer sent before it went: and no end
                yield [PRODUCER_LOST]
                return

    async def _still_produced(self, gateway: str, skey: str) -> int | None:
        """After a quiet wait: how long the next read blocks (its ms); ``None``: once, not
        at all (the producer's heartbeat is gone); -1: the copy itself is gone."""
        link = self._link
        pipe = link.client.pipeline(transaction=False)
        pipe.exists(link.keys.alive(gateway))
        pipe.exists(skey)
        try:
            async with asyncio.timeout(link.timings.command_timeout_s):
                alive, exists = await pipe.execute()
        except FAILURES as exc:
            link.failed(exc, "stream read")
            return int(link.timings.read_block_s * 1000)  # the next read finds out
        if not exists:
            return -1
        return int(link.timings.read_block_s * 1000) if alive else None


class _Read:
    """Reading a copy's entries from seq ``seq`` on: ``take`` each (in order); whether it
    was the last to read. ``events``: what they held from ``seq`` on. On the ``first``
    read of a resume, a copy that no longer holds ``seq`` says so (``kept_from``); later,
    a gap ends the events with a ``stream_events_lost`` error event."""

    __slots__ = ("done", "events", "first", "kept_from", "last_id", "seq")

    def __init__(self, seq: int, *, first: bool):
        self.seq = seq  # the next seq wanted
        self.kept_from = seq  # past the first wanted: the copy no longer keeps it
        self.events: list[bytes] = []
        self.done = False
        self.first = first
        self.last_id: bytes | str = f"0-{seq}"

    def take(self, fields: Mapping[bytes, bytes]) -> bool:
        first, self.first = self.first, False
        data = fields.get(b"d")
        if data is not None:
            at = int(fields[b"s"])
            if at > self.seq:  # a gap: trimmed, or lost
                return self._gone(at) if first else self._lost()
            datas = data.split(b"\n")
            self.events.extend(datas[self.seq - at :])  # a batch sent twice counts once
            self.seq = max(self.seq, at + len(datas))
            return False
        if b"x" in fields:  # the copy lost what follows
            return self._gone(int(fields[b"x"]) + 1) if first else self._lost()
        self.done = True  # b"e": the end
        return True

    def _gone(self, kept_from: int) -> bool:
        self.kept_from = kept_from
        self.done = True
        return True

    def _lost(self) -> bool:
        self.events.append(LOST)
        self.done = True
        return True


def _end_of(fields: Mapping[bytes, bytes]) -> int:
    """The seq after the events of a copy's entry."""
    if b"d" in fields:
        return int(fields[b"s"]) + fields[b"d"].count(b"\n") + 1
    return int(fields.get(b"e", fields.get(b"x", b"0")))


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of an XREAD reply of one stream (RESP2: a list; RESP3: a map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(next(iter(reply.values()))[0])
    return list(reply[0][1])

"""Streams shared through Redis: each streamed response's events are copied there as they
are produced, so that ``GET /v1/streams/{id}`` works on any gateway of the fleet.

:class:`StreamReplicator` is the store's :class:`~quantroute.resilience.resume.Replication`
(``StreamStore(settings, replication=...)``). The store's stream hands each event to its
copy (:class:`_Copy`: a list append, in the appending task); one writer task sends what
piled up every ``flush_s`` (50 ms), in one call of one Lua script for all streams (one
round trip, one command to pack and parse): each stream's events of that round become
one ``XADD`` entry. So a token costs the hot path an append, and Redis one entry per
stream per round, not one per token. What waits to be sent is bounded
(``streams.max_bytes / 16``, at least 1 MiB): past it, while Redis is slow or down, a
stream's copy stops (its events are dropped from the copy, counted in
:attr:`StreamReplicator.dropped`, logged once per outage) and a *lost* mark ends it, so
a reader elsewhere gets an error event where the copy stops, never a silent end. The
stream itself, and its readers on its own gateway, never wait on any of this.

Keys, for a stream ``K`` under the prefix ``P`` (``cluster.name``):

- ``P:stream:{K}`` (a Redis Stream): an entry per batch of events, id ``0-<last seq + 1>``,
  fields ``s`` (the first seq) and ``d`` (the events' data joined by ``\\n``, which an SSE
  event's data never holds); the end is an entry ``e`` (the seq after the last event),
  id ``0-<that + 1>``; a copy that lost events ends with an entry ``x`` (the first seq
  lost). ``XADD MAXLEN ~ streams.max_events_per_stream``; the events the store sheds
  (``streams.max_bytes``) are trimmed (``XTRIM MINID ~``) and a stream it drops is deleted.
- ``P:stream:{K}:meta`` (a string, JSON): ``owner`` (the tenant), ``token`` (sha256 of the
  stream token, hex), ``gateway`` (the producer's id: its heartbeat is
  ``P:gateway:<id>``, ``cluster/redis_link.py``), ``headers`` (of the response that
  started it).

Both expire ``streams.retention_s`` after the stream's end, and ``retention_s + 60`` s
after the last renewal while it is live (renewed every 20 s).

Reading another gateway's stream (:meth:`StreamReplicator.lookup`, from
``StreamStore.find``): ``cluster/redis_stream_reader.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from quantroute.cluster.redis_link import FAILURES, RedisLink
from quantroute.cluster.redis_stream_reader import CopyReader
from quantroute.config import StreamSettings
from quantroute.resilience.resume import RemoteCopy
from quantroute.resilience.stream import token_digest
from quantroute.tasks import cancel_and_wait

__all__ = ["StreamReplicator"]

log = logging.getLogger(__name__)

LIVE_MARGIN_S = 60.0  # a live copy outlives its last renewal by retention_s + this
RENEW_S = 20.0  # how often live copies' expiry is renewed


# A flush: per stream its two keys, and one argument: a head line ``FLAGS FIRST LAST FLOOR
# LOST END`` ("-": none; flags: ``c`` create the meta, whose JSON is the next argument,
# ``x`` start the stream's expiry, ``f`` forget it) and then its events' data. After the
# three common ones: MAXLEN, the live expiry and the retention (ms). A batch sent twice
# (a retry after a reply that did not come) is refused by its id: pcall; readers skip
# repeats. One argument per stream: redis-py packs each argument in Python.
_COPY = """
local maxlen, live, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local a = 4
for i = 1, #KEYS, 2 do
  local s, m, arg = KEYS[i], KEYS[i + 1], ARGV[a]
  a = a + 1
  local nl = string.find(arg, '\\n', 1, true)
  local flags, first, last, floor, lost, fin = string.match(
    string.sub(arg, 1, nl - 1), '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$')
  if string.find(flags, 'f', 1, true) then
    redis.call('DEL', s, m)
  else
    if string.find(flags, 'c', 1, true) then
      redis.call('SET', m, ARGV[a], 'PX', live)
      a = a + 1
    end
    if first ~= '-' then
      redis.pcall('XADD', s, 'MAXLEN', '~', maxlen, '0-' .. last,
                  's', first, 'd', string.sub(arg, nl + 1))
      if string.find(flags, 'x', 1, true) then redis.call('PEXPIRE', s, live) end
    end
    if floor ~= '-' then redis.call('XTRIM', s, 'MINID', '~', '0-' .. floor) end
    if lost ~= '-' then redis.pcall('XADD', s, '0-' .. (tonumber(lost) + 1), 'x', lost) end
    if fin ~= '-' then
      redis.pcall('XADD', s, '0-' .. (tonumber(fin) + 1), 'e', fin)
      redis.call('PEXPIRE', s, keep)
      redis.call('PEXPIRE', m, keep)
    end
  end
end
return 0
"""


class _Copy:
    """One stream's copy: what waits to be sent, and what the copy has said already.
    The stream calls ``add``/``extend``/``trimmed``/``end``/``forget``
    (:class:`~quantroute.resilience.stream.Replica`)."""

    __slots__ = (
        "_out",
        "broken_at",
        "created",
        "end_seq",
        "ended",
        "expiring",
        "floor",
        "floor_sent",
        "forgotten",
        "key",
        "lost_sent",
        "meta",
        "pending",
        "start",
    )

    def __init__(self, out: StreamReplicator, key: str, meta: bytes):
        self._out = out
        self.key = key
        self.meta = meta
        self.pending: list[bytes] = []  # events not sent yet, from seq ``start`` on
        self.start = 0
        self.broken_at: int | None = None  # the first seq dropped from the copy
        self.end_seq: int | None = None
        self.floor = 0  # the stream keeps the events from here on
        self.floor_sent = 0
        self.created = self.expiring = self.lost_sent = self.ended = self.forgotten = False

    def add(self, seq: int, data: bytes) -> None:
        out = self._out
        if self.broken_at is not None:
            out.dropped += 1
            return
        if out.pending_bytes >= out.max_pending_bytes:
            out.lose(self, seq, 1)
            return
        pending = self.pending
        if not pending:
            self.start = seq
            out.mark(self)
        pending.append(data)
        out.pending_bytes += len(data)

    def extend(self, seq: int, datas: Sequence[bytes]) -> None:
        out = self._out
        if self.broken_at is not None:
            out.dropped += len(datas)
            return
        if out.pending_bytes >= out.max_pending_bytes:
            out.lose(self, seq, len(datas))
            return
        pending = self.pending
        if not pending:
            self.start = seq
            out.mark(self)
        pending.extend(datas)
        out.pending_bytes += sum(map(len, datas))

    def trimmed(self, first_seq: int) -> None:
        self.floor = first_seq  # sent with the next batch, where MAXLEN does not cover it

    def end(self, next_seq: int) -> None:
        self.end_seq = next_seq
        self._out.mark(self)

    def forget(self) -> None:
        self.forgotten = True
        self._out.mark(self)


class StreamReplicator:
    """Copies a gateway's streams to Redis and reads other gateways' copies back; see the
    module docstring. ``start`` before the first stream, ``close`` after the last (it
    sends what is pending, within ``command_timeout_s``)."""

    def __init__(self, link: RedisLink, settings: StreamSettings):
        self._link = link
        self._settings = settings
        self.max_pending_bytes = max(1 << 20, settings.max_bytes // 16)
        self.pending_bytes = 0
        self.dropped = 0  # events not copied (Redis slow or down)
        self.batches = 0  # pipelines sent
        self._dirty: dict[str, _Copy] = {}  # copies with something to send
        self._live: dict[str, _Copy] = {}  # copies not ended: their expiry is renewed
        self._retry: dict[str, _Copy] = {}  # copies whose marks failed: sent once Redis is back
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sending = False  # a pipeline is out
        self._loss_logged = False
        self._renewed_at = time.monotonic()
        self._live_ms = int((settings.retention_s + LIVE_MARGIN_S) * 1000)
        self._retention_ms = max(1000, int(settings.retention_s * 1000))
        self._copy = link.client.register_script(_COPY)
        self._reader = CopyReader(link, settings)
        link.on_up(self._recovered)

    # -- the store's side (Replication) ---------------------------------------------

    def replicate(self, key: str, owner: str, token: str, headers: Mapping[str, str]) -> _Copy:
        meta = {
            "owner": owner,
            "token": token_digest(token),
            "gateway": self._link.gateway,
            "headers": dict(headers),
        }
        copy = _Copy(self, key, json.dumps(meta, separators=(",", ":")).encode())
        self._live[key] = copy
        return copy

    def mark(self, copy: _Copy) -> None:
        self._dirty[copy.key] = copy
        self._wake.set()

    def lose(self, copy: _Copy, seq: int, n: int) -> None:
        """The copy of ``copy``'s stream stops at ``seq``: too much waits to be sent."""
        copy.broken_at = seq
        self.dropped += n
        self.mark(copy)
        if not self._loss_logged:
            self._loss_logged = True
            log.warning(
                "stream copies: %d bytes wait for Redis, the most allowed; stream %s and "
                "others are no longer copied (resumable on their own gateway only)",
                self.pending_bytes,
                copy.key,
            )

    def status(self) -> dict[str, Any]:
        """What ``/admin/status`` may show of the copies."""
        return {
            "live_copies": len(self._live),
            "pending_bytes": self.pending_bytes,
            "dropped_events": self.dropped,
            "batches": self.batches,
        }

    @property
    def idle(self) -> bool:
        """Nothing waits to be sent, and nothing is being sent."""
        return not self._dirty and not self._sending

    # -- the writer -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-streams")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._dirty and self._link.up:  # the ends of streams the store just closed
            batch, self._dirty = self._dirty, {}
            await self._flush(batch.values())

    def _recovered(self) -> None:
        self._loss_logged = False
        for c in self._live.values():  # Redis may have restarted empty: say it all again
            c.created = c.expiring = False
        self._dirty.update(self._retry)
        self._retry.clear()
        self._wake.set()

    async def _run(self) -> None:
        timings = self._link.timings
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RENEW_S):  # quiet: the live copies still expire
                    await self._wake.wait()
            await asyncio.sleep(timings.flush_s)  # what comes meanwhile goes in this batch
            self._wake.clear()
            if not self._link.up:
                continue  # held (bounded) until Redis answers again: _recovered wakes us
            batch, self._dirty = self._dirty, {}
            await self._flush(batch.values())
            if time.monotonic() - self._renewed_at >= RENEW_S:
                await self._renew()

    async def _flush(self, copies: Iterable[_Copy]) -> None:
        """Send what ``copies`` have waiting: every stream's in one script call (one
        round trip, one command to pack and parse, whatever the number of streams)."""
        keys = self._link.keys
        names: list[str] = []
        args: list[bytes | int] = [
            self._settings.max_events_per_stream,
            self._live_ms,
            self._retention_ms,
        ]
        sent: list[tuple[_Copy, list[bytes], int]] = []
        for c in copies:
            events, first = c.pending, c.start
            c.pending = []
            c.start = first + len(events)
            self.pending_bytes -= sum(map(len, events))
            sent.append((c, events, first))
            names += (keys.stream(c.key), keys.stream_meta(c.key))
            last = first + len(events)
            create = not c.created and not c.forgotten
            flags = (
                (b"f" if c.forgotten else b"")
                + (b"c" if create else b"")
                + (b"x" if events and not c.expiring else b"")
            )
            trim = c.floor > c.floor_sent and c.floor > last - self._settings.max_events_per_stream
            head = b"%s %s %d %s %s %s\n" % (
                flags or b"-",
                _n(first if events else None),
                last,
                _n(c.floor + 1 if trim else None),
                _n(None if c.lost_sent else c.broken_at),
                _n(None if c.ended else c.end_seq),
            )
            args.append(head + b"\n".join(events))
            if create:
                args.append(c.meta)
        if not sent:
            return
        self._sending = True
        try:
            async with asyncio.timeout(self._link.timings.command_timeout_s):
                await self._copy(names, args)
        except FAILURES as exc:
            self._link.failed(exc, "stream copy")
            for c, events, first in sent:  # sent again once Redis answers (duplicates: skipped)
                c.pending[:0] = events
                c.start = first
                self.pending_bytes += sum(map(len, events))
                self._retry[c.key] = c
            return
        finally:
            self._sending = False
        self.batches += 1
        for c, events, _ in sent:
            c.created = True
            c.expiring = c.expiring or bool(events)
            c.floor_sent = max(c.floor_sent, c.floor)
            c.lost_sent = c.broken_at is not None
            if c.end_seq is not None or c.forgotten:
                c.ended = True
                self._live.pop(c.key, None)

    async def _renew(self) -> None:
        """Push back the expiry of the copies still live (their producer may be quiet)."""
        self._renewed_at = time.monotonic()
        if not self._live:
            return
        keys = self._link.keys
        pipe = self._link.client.pipeline(transaction=False)
        for key in self._live:
            pipe.pexpire(keys.stream(key), self._live_ms)
            pipe.pexpire(keys.stream_meta(key), self._live_ms)
        try:
            async with asyncio.timeout(self._link.timings.command_timeout_s):
                await pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            self._link.failed(exc, "stream expiry")

    # -- the reader's side ------------------------------------------------------------

    async def lookup(self, key: str, after: int | None) -> RemoteCopy | None:
        """Another gateway's copy of the stream ``key`` (``cluster/redis_stream_reader.py``)."""
        return await self._reader.lookup(key, after)


def _n(value: int | None) -> bytes:
    return b"-" if value is None else b"%d" % value

"""Resumable streams: a stream's events outlive its HTTP response.

A :class:`StreamStore` runs each stream's producer (the generation, as event
payloads) in a task of its own and numbers and keeps what it produces, so the
response that started it is only its first *watcher*. A watcher follows the
stream from any event on (:meth:`Stream.follow`): the kept events after it,
then the live rest as it comes, then the end. A client that drops and comes
back (``Last-Event-ID``) gets exactly the events it missed::

    store = StreamStore(StreamSettings())
    stream = store.open("job-1", "acme", rest, close=run.close, grace_s=10, first=head)
    async for item in stream.follow(after=None, keepalive_s=15): ...   # the first client
    async for item in store.get("job-1", "acme", after=41).follow(41, 15): ...  # it, again

``first`` are events that are ready already (a stream's opening chunks and first
token): they are the stream's before its producer first runs, so the first
watcher writes them without waiting for a task.

When a stream's last watcher leaves before the end, the producer goes on for
``grace_s`` (0: not at all) and is then cancelled if nobody came back, which
closes the generation and frees its slot. A finished stream is kept for
``retention_s``; the store holds at most ``max_streams`` (the oldest finished
go first; live streams always stay, admission bounds them) and each the
latest ``max_events_per_stream``. The events kept, all streams together, are
at most ``max_bytes``: past it the store sheds down to 15/16 of it, first the
oldest finished streams whole, then the oldest events of live ones (those
their readers have passed first); a reader, or a resume, from before what is
kept gets ``stream_events_gone`` (``resilience/kept_bytes.py``). A producer
held back by a stalled reader ends its stream with a ``reader_stalled`` error,
which frees its generation. Only the owner (a tenant name) may follow, and,
where the caller says so (an open API, where every stream's owner is the same
``anonymous``), only with the stream's secret token.

One stream, its readers and the backpressure they put on its producer:
``resilience/stream.py`` (:class:`Stream`, re-exported here).

With a :class:`Replication` (``cluster.redis_url``: ``cluster/redis_streams.py``) each
stream's events are also copied for the other gateways of a fleet, off the append's
path, and a resume of a stream this gateway does not hold (:meth:`StreamStore.find`)
reads that copy: the events after ``Last-Event-ID``, then the live rest while its own
gateway still produces it, then its end, or an error event where the copy cannot say
more (its gateway died, events were not copied). The owner and the token's digest
travel with the copy, so the same checks hold on every gateway. A stream shed here
(``max_bytes``, ``max_streams``) is shed from the copy too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from quantroute.config import StreamSettings
from quantroute.errors import NotFoundError, QuantrouteError, RateLimitError
from quantroute.resilience.kept_bytes import KeptBytes, shed
from quantroute.resilience.stream import (
    ATTACH_S,
    ReaderStalledError,
    Replica,
    Stream,
    token_digest,
)

__all__ = ["ReaderStalledError", "RemoteCopy", "Replication", "Stream", "StreamStore"]

log = logging.getLogger(__name__)


def _payload(error: QuantrouteError) -> bytes:
    return json.dumps(error.to_openai(), separators=(",", ":")).encode()


CANCELLED = _payload(
    QuantrouteError(
        "the stream was cancelled: its client left and did not come back in time",
        code="stream_cancelled",
    )
)
FAILED = _payload(QuantrouteError("internal error while streaming"))


@dataclass(frozen=True, slots=True)
class RemoteCopy:
    """What the fleet's copy of a stream holds from a resume's first event on."""

    owner: str
    token_digest: str  # of the stream's token (``stream.token_digest``)
    headers: Mapping[str, str]  # of the response that started it
    kept_from: int  # the first seq, from the resume's first on, that the copy holds
    events: Sequence[bytes]  # from ``kept_from`` on, in order
    next_seq: int  # the seq after the copy's last event (it may lag its producer)
    rest: AsyncIterator[list[bytes]] | None  # the events after them; None: it ended


class Replication(Protocol):
    """Where a store's streams are copied for other gateways, and read back from theirs
    (``cluster/redis_streams.py``)."""

    def replicate(self, key: str, owner: str, token: str, headers: Mapping[str, str]) -> Replica:
        """A new copy of the stream ``key``; the stream hands it its events."""
        ...

    async def lookup(self, key: str, after: int | None) -> RemoteCopy | None:
        """The copy of the stream ``key`` from the event after ``after`` on; ``None``: no
        copy. Raises :class:`~quantroute.errors.ServiceUnavailableError` when the copies
        cannot be read now."""
        ...


def _not_found() -> NotFoundError:
    return NotFoundError("no such stream: unknown, expired, or not yours", code="stream_not_found")


def _gone() -> NotFoundError:
    return NotFoundError(
        "the stream's events after that id are no longer kept", code="stream_events_gone"
    )


class StreamStore:
    """The streams of one gateway, by key; see the module docstring. ``close`` on shutdown."""

    def __init__(self, settings: StreamSettings, replication: Replication | None = None):
        self.settings = settings
        self._budget = KeptBytes(settings.max_bytes, self._shed)
        self._streams: dict[str, Stream] = {}  # in the order they opened
        self._finished: OrderedDict[str, Stream] = OrderedDict()  # in the order they ended
        self._closers: dict[str, Callable[[], Awaitable[None]]] = {}  # not yet called
        self._replication = replication
        self._mirrors: set[Stream] = set()  # resumes of other gateways' streams, following

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the events kept, all streams together (at most ``max_bytes``)."""
        return self._budget.used

    def open(
        self,
        key: str,
        owner: str,
        source: AsyncIterator[bytes | list[bytes]],
        *,
        close: Callable[[], Awaitable[None]],
        grace_s: float,
        headers: Mapping[str, str] | None = None,
        first: Iterable[bytes] = (),
        stall_timeout_s: float | None = None,
    ) -> Stream:
        """Start producing ``source`` into a new stream, after the events ``first``;
        ``close`` is awaited once when it ends, however it ends (it frees the generation).
        ``source`` yields an event's data, or a list of events that came together (they go
        out in one write where they can: :meth:`Stream.extend`)."""
        if key in self._streams:
            raise ValueError(f"stream {key} exists")
        while len(self._streams) >= self.settings.max_streams and self._finished:
            self._evict(next(iter(self._finished)))
        stream = Stream(
            key,
            owner,
            headers or {},
            self.settings.max_events_per_stream,
            grace_s,
            stall_timeout_s,
            self._budget,
        )
        if self._replication is not None:  # before the first event: the copy has them all
            stream._replica = self._replication.replicate(key, owner, stream.token, stream.headers)
        for data in first:
            stream.append(data)
        self._streams[key] = stream
        self._closers[key] = close
        producer = asyncio.get_running_loop().create_task(
            self._produce(stream, source), name=f"stream:{key}"
        )
        stream._producer = producer
        producer.add_done_callback(stream._produced)
        stream._arm(max(grace_s, ATTACH_S))
        return stream

    def get(
        self,
        key: str,
        owner: str,
        after: int | None = None,
        *,
        token: str | None = None,
        token_required: bool = False,
    ) -> Stream:
        """The stream ``key`` of ``owner`` that still keeps the events after ``after``;
        a 404 otherwise (unknown, expired, another owner's, or a ``token`` that is not the
        stream's, or none where one is ``token_required``: the same answer)."""
        stream = self._streams.get(key)
        if stream is not None and self._expired(stream):
            self._drop(key)
            stream = None
        if stream is None or stream.owner != owner or not stream.opens_with(token, token_required):
            raise _not_found()
        if not stream.keeps_after(after):
            raise _gone()
        limit = self.settings.max_readers
        if not stream.let_in(limit, time.monotonic()):
            raise RateLimitError(
                f"this stream has {limit} readers, its limit; retry once one has left",
                retry_after_s=1.0,
            )
        return stream

    async def find(
        self,
        key: str,
        owner: str,
        after: int | None = None,
        *,
        token: str | None = None,
        token_required: bool = False,
    ) -> Stream:
        """:meth:`get`, or, for a stream this gateway does not hold, a stream that follows
        the fleet's copy of it (with a :class:`Replication`): the same checks, the same
        answers. A resume after the copy's last event waits for more while the copy is
        live (it may lag its producer by a batch); after a finished copy's last event,
        the stream it returns ends there (``next_seq``: the route says it is past)."""
        replication = self._replication
        if replication is None or key in self._streams:
            return self.get(key, owner, after, token=token, token_required=token_required)
        copy = await replication.lookup(key, after)
        if copy is None or copy.owner != owner or not _opens(copy, token, token_required):
            raise _not_found()
        start = 0 if after is None else after + 1
        if copy.kept_from > start:
            raise _gone()
        if copy.rest is None:
            start = min(start, copy.next_seq)
        s = self.settings
        stall_s = None  # a reader here holds back nothing but its own copy
        budget = KeptBytes(s.max_bytes)  # its own: at most max_events_per_stream events
        mirror = Stream(
            key, owner, copy.headers, s.max_events_per_stream, 0.0, stall_s, budget, start
        )
        if copy.events:
            mirror.extend(copy.events)
        loop = asyncio.get_running_loop()
        if copy.rest is None:
            mirror.end(loop.time())
            return mirror
        self._mirrors.add(mirror)
        producer = loop.create_task(self._produce(mirror, copy.rest), name=f"stream-copy:{key}")
        mirror._producer = producer
        producer.add_done_callback(mirror._produced)
        mirror._arm(ATTACH_S)
        return mirror

    async def close(self) -> None:
        """Cancel every producer (closing its generation) and forget every stream."""
        streams = [*self._streams.values(), *self._mirrors]
        for stream in streams:
            stream.cancel()
        tasks = [s._producer for s in streams if s._producer is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for key in list(self._closers):  # in case a producer never ran (cancelled outside)
            await self._call_close(key)
        for key in list(self._streams):
            self._drop(key)

    # -- inside ------------------------------------------------------------------

    async def _produce(self, stream: Stream, source: AsyncIterator[bytes | list[bytes]]) -> None:
        stream._started = True
        try:
            if stream._stopping:
                raise asyncio.CancelledError
            await _pump(stream, source)
        except asyncio.CancelledError:
            stream.append(CANCELLED)
            raise
        except ReaderStalledError as exc:
            log.warning("stream %s: %s", stream.key, exc.message)
            stream.append(_payload(exc))
        except Exception:
            log.exception("stream %s failed", stream.key)
            stream.append(FAILED)
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if stream in self._mirrors:  # a copy's follower: nothing of this gateway's to free
                self._mirrors.discard(stream)
                stream.end(asyncio.get_running_loop().time())
            else:
                try:
                    await self._call_close(stream.key)
                finally:
                    self._ended(stream)

    async def _call_close(self, key: str) -> None:
        close = self._closers.pop(key, None)
        if close is not None:
            try:
                await close()
            except Exception:
                log.exception("stream %s: closing its generation failed", key)

    def _ended(self, stream: Stream) -> None:
        loop = asyncio.get_running_loop()
        stream.end(loop.time())
        if self._streams.get(stream.key) is not stream:
            return  # dropped already (shutdown)
        self._finished[stream.key] = stream
        stream._expiry = loop.call_later(self.settings.retention_s, self._expire, stream)

    def _expire(self, stream: Stream) -> None:
        if self._streams.get(stream.key) is stream:
            self._drop(stream.key)

    def _expired(self, stream: Stream) -> bool:
        return (
            stream.ended_at is not None
            and asyncio.get_running_loop().time() - stream.ended_at >= self.settings.retention_s
        )

    def _shed(self) -> None:
        shed(self._budget, self._finished, self._streams, self._evict)

    def _evict(self, key: str) -> None:
        """Forget a stream to keep the bounds (``max_bytes``, ``max_streams``): its copy too."""
        stream = self._streams.get(key)
        if stream is not None and stream._replica is not None:
            stream._replica.forget()
        self._drop(key)

    def _drop(self, key: str) -> None:
        stream = self._streams.pop(key, None)
        self._finished.pop(key, None)
        if stream is not None:
            stream._leave_budget()
            stream._cancel_reaper()
            if stream._expiry is not None:
                stream._expiry.cancel()


async def _pump(stream: Stream, source: AsyncIterator[bytes | list[bytes]]) -> None:
    """Append what ``source`` yields to ``stream``, never further ahead of its slowest reader
    than its window allows (:meth:`Stream.room`)."""
    async for data in source:
        if isinstance(data, bytes):
            if stream.next_seq - stream._floor() >= stream._ahead:  # else a no-op
                await stream.room()
            stream.append(data)
        elif stream.room_for(len(data)):
            stream.extend(data)
        else:  # near the window's edge: each waits for its room
            for one in data:
                await stream.room()
                stream.append(one)


def _opens(copy: RemoteCopy, token: str | None, required: bool) -> bool:
    """:meth:`Stream.opens_with` for a copy, which keeps the token's digest only."""
    if token is None:
        return not required
    return hmac.compare_digest(token_digest(token), copy.token_digest)

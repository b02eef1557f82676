"""The stream store is bounded in bytes across all its streams (``streams.max_bytes``), not
only in count: ~2.6 MB a stream with logprobs, 1024 streams, was 2.6 GB kept (issue 32,
L-findings). Over the bound the oldest finished streams go first, then the oldest events
of live ones (those every reader has passed first); a resume from before what is kept is a
404, as for ``max_events_per_stream``. Also the per-stream secret a resume must show
where the caller requires one (an open API)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from qrtest import StreamSource as Source
from quantroute.config import StreamSettings
from quantroute.errors import NotFoundError
from quantroute.resilience.resume import Stream, StreamStore

MiB = 1 << 20
EVENT = b"x" * (64 << 10)  # 64 KiB: 16 of them are the smallest bound settings allow


def _store(**settings: Any) -> StreamStore:
    return StreamStore(StreamSettings(**settings))


def _open(store: StreamStore, key: str, owner: str = "acme") -> tuple[Stream, Source]:
    source = Source()
    stream = store.open(key, owner, source.events(), close=source.close, grace_s=5.0)
    return stream, source


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _finished(store: StreamStore, key: str, events: int) -> Stream:
    stream, source = _open(store, key)
    source.put(*[EVENT] * events)
    source.finish()
    while not stream.done:  # noqa: ASYNC110 (the producer task runs it to its end)
        await asyncio.sleep(0)
    return stream


def _kept(*streams: Stream) -> int:
    return sum(len(event) for stream in streams for event in stream._events)


async def test_over_max_bytes_the_oldest_finished_streams_go_first() -> None:
    store = _store(max_bytes=MiB, max_streams=1024)
    old = [await _finished(store, f"s{i}", 4) for i in range(4)]  # 4 x 256 KiB: the bound
    assert store.kept_bytes == MiB == _kept(*old)
    store.get("s0", "acme")  # all four kept
    await _finished(store, "new", 4)  # 256 KiB more: over, so the oldest finished go
    assert store.kept_bytes <= MiB
    with pytest.raises(NotFoundError):
        store.get("s0", "acme")
    assert store.get("new", "acme").kept_bytes == 4 * len(EVENT)
    assert store.get("s3", "acme").done
    assert sorted(store._streams) == ["new", "s1", "s2", "s3"]
    assert store.kept_bytes == _kept(*store._streams.values()) == MiB
    await store.close()
    assert store.kept_bytes == 0


async def test_live_streams_lose_their_oldest_read_events_before_unread_ones() -> None:
    store = _store(max_bytes=MiB, max_events_per_stream=4096)
    live, source = _open(store, "live")
    source.put(*[EVENT] * 12)  # 768 KiB
    follow = live.follow(None, keepalive_s=5)
    for seq in range(12):  # a reader that read all twelve, and waits for more
        assert (await anext(follow))[0] == seq  # type: ignore[index]
    reading = asyncio.ensure_future(anext(follow))
    await _settle()
    other, other_source = _open(store, "other")
    other_source.put(*[EVENT] * 8)  # nobody has read these: 1.25 MiB in all, over
    await _settle()
    assert store.kept_bytes <= MiB
    assert other.first_seq == 0 and other.next_seq == 8  # unread: all kept
    assert live.first_seq > 0  # the read ones went
    with pytest.raises(NotFoundError) as gone:
        store.get("live", "acme", after=None)  # a resume from its start: no longer kept
    assert gone.value.error_code == "stream_events_gone"
    source.put(b"[DONE]")
    assert await reading == (12, b"[DONE]")  # the reader lost nothing it had not read
    source.finish()
    other_source.finish()
    await store.close()


async def test_unread_events_go_last_and_their_reader_is_told() -> None:
    store = _store(max_bytes=MiB, max_events_per_stream=4096)
    live, source = _open(store, "live")
    follow = live.follow(None, keepalive_s=5)
    source.put(EVENT)
    assert await anext(follow) == (0, EVENT)
    reading = asyncio.ensure_future(anext(follow))
    await _settle()
    source.put(*[EVENT] * 20)  # 1.3 MiB unread by its one reader: over, nothing else to shed
    await _settle()
    assert store.kept_bytes <= MiB
    assert live.next_seq == 21 and live.first_seq > 1
    with pytest.raises(NotFoundError) as gone:
        await reading  # the reader is behind what is kept: told, not stalled
    assert gone.value.error_code == "stream_events_gone"
    source.finish()
    await store.close()


async def test_the_byte_count_follows_appends_and_the_event_bound() -> None:
    store = _store(max_bytes=MiB, max_events_per_stream=16)
    stream, source = _open(store, "s")
    source.put(*[b"%d" % i for i in range(100)])
    source.put_together(b"a" * 10, b"b" * 20)  # appended at once (Stream.extend)
    source.finish()
    got = [item async for item in stream.follow(None, keepalive_s=5) if item is not None]
    assert len(got) == 102  # a reader keeping up: every event; the latest 16 kept
    assert stream.next_seq == 102 and stream.first_seq == 102 - 16
    assert stream.kept_bytes == store.kept_bytes == _kept(stream) == 14 * 2 + 30
    await store.close()


async def test_a_stream_opens_only_with_its_token_where_one_is_required() -> None:
    store = _store()
    stream, source = _open(store, "k", owner="anonymous")
    other, other_source = _open(store, "k2", owner="anonymous")
    assert len(stream.token) >= 32 and stream.token != other.token
    for token in (None, "", "0" * 32, other.token, stream.token[:-1], "é" * 32):
        with pytest.raises(NotFoundError) as refused:
            store.get("k", "anonymous", token=token, token_required=True)
        assert refused.value.error_code == "stream_not_found"  # as for an unknown stream
    assert store.get("k", "anonymous", token=stream.token, token_required=True) is stream
    # where the owner is the check (tenants), a token is optional, but a wrong one fails
    assert store.get("k", "anonymous") is stream
    with pytest.raises(NotFoundError):
        store.get("k", "anonymous", token=other.token)
    with pytest.raises(NotFoundError):
        store.get("k", "someone", token=stream.token, token_required=True)
    source.finish()
    other_source.finish()
    await store.close()

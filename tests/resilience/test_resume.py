"""The stream store on plain asyncio: numbering, replay after N, the live tail, the grace
before a dropped stream is cancelled, expiry, bounds, backpressure and the owner check."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import weakref
from typing import Any

import pytest

from qrtest import StreamSource as Source
from quantroute.config import StreamSettings
from quantroute.errors import NotFoundError
from quantroute.resilience.resume import CANCELLED, Stream, StreamStore


def _store(**settings: Any) -> StreamStore:
    return StreamStore(StreamSettings(**settings))


def _open(
    store: StreamStore, key: str = "k", owner: str = "acme", grace_s: float = 0.0, **kw: Any
) -> tuple[Stream, Source]:
    source = Source()
    stream = store.open(key, owner, source.events(), close=source.close, grace_s=grace_s, **kw)
    return stream, source


async def _read(
    stream: Stream, after: int | None, count: int | None = None
) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    async for item in stream.follow(after, keepalive_s=5):
        assert item is not None
        out.append(item)
        if count is not None and len(out) == count:
            break
    return out


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_events_are_numbered_and_replayed_after_n_then_the_live_tail() -> None:
    store = _store()
    stream, source = _open(store)
    source.put(b"a", b"b", b"c")
    first = await _read(stream, None, count=2)  # a client reads two, then drops
    assert first == [(0, b"a"), (1, b"b")]
    resumed = asyncio.create_task(_read(store.get("k", "acme", after=1), after=1))
    await _settle()
    source.put(b"d", b"[DONE]")  # produced while the resumer waits: the live tail
    source.finish()
    assert await resumed == [(2, b"c"), (3, b"d"), (4, b"[DONE]")]
    assert stream.done and source.closed.is_set()
    # a finished stream replays whole, from the start or after any N
    assert [d for _, d in await _read(store.get("k", "acme"), None)] == [
        b"a",
        b"b",
        b"c",
        b"d",
        b"[DONE]",
    ]
    assert await _read(store.get("k", "acme", after=3), after=3) == [(4, b"[DONE]")]
    await store.close()


async def test_a_watcher_gets_keepalives_while_idle() -> None:
    store = _store()
    stream, source = _open(store)
    items = stream.follow(None, keepalive_s=0.05)
    assert await anext(items) is None  # idle: a keep-alive tick
    source.put(b"x")
    assert await anext(items) == (0, b"x")
    await items.aclose()
    await store.close()


async def test_with_no_grace_the_last_watcher_leaving_cancels_at_once() -> None:
    store = _store()
    stream, source = _open(store, grace_s=0)
    source.put(b"a")
    assert await _read(stream, None, count=1) == [(0, b"a")]  # break: the watcher leaves
    await asyncio.wait_for(source.closed.wait(), 1)
    await _settle()
    assert stream.done
    # what it had, then why it ended: no [DONE]
    assert [d for _, d in await _read(store.get("k", "acme"), None)] == [b"a", CANCELLED]
    assert json.loads(CANCELLED)["error"]["code"] == "stream_cancelled"
    await store.close()


async def test_within_the_grace_generation_goes_on_and_a_reconnect_gets_the_rest() -> None:
    store = _store()
    stream, source = _open(store, grace_s=0.3)
    source.put(b"a", b"b")
    assert await _read(stream, None, count=1) == [(0, b"a")]  # dropped after one event
    source.put(b"c")
    await asyncio.sleep(0.1)
    assert not source.closed.is_set() and source.produced == 3  # still generating
    resumed = asyncio.create_task(_read(store.get("k", "acme", after=0), after=0))
    await asyncio.sleep(0.4)  # past the grace, but someone is watching again
    assert not source.closed.is_set()
    source.put(b"[DONE]")
    source.finish()
    assert await resumed == [(1, b"b"), (2, b"c"), (3, b"[DONE]")]
    await store.close()


async def test_nobody_back_within_the_grace_cancels_the_generation() -> None:
    store = _store()
    stream, source = _open(store, grace_s=0.1)
    source.put(b"a")
    await _read(stream, None, count=1)
    await asyncio.sleep(0.05)
    assert not source.closed.is_set()
    await asyncio.wait_for(source.closed.wait(), 1)
    await _settle()
    assert stream.done
    await store.close()


async def test_a_stream_nobody_ever_reads_is_cancelled_after_the_attach_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("quantroute.resilience.resume.ATTACH_S", 0.05)
    store = _store()
    _, source = _open(store, grace_s=0)
    await asyncio.wait_for(source.closed.wait(), 1)
    await store.close()


async def test_finished_streams_expire_after_the_retention() -> None:
    store = _store(retention_s=0.1)
    _, source = _open(store)
    source.put(b"[DONE]")
    source.finish()
    await asyncio.wait_for(source.closed.wait(), 1)
    await _settle()
    assert store.get("k", "acme").done
    await asyncio.sleep(0.15)
    with pytest.raises(NotFoundError) as info:
        store.get("k", "acme")
    assert (
        info.value.status == 404 and info.value.to_openai()["error"]["code"] == "stream_not_found"
    )
    assert len(store) == 0  # the timer dropped it, too


async def test_only_the_owner_may_follow_and_unknown_streams_404() -> None:
    store = _store()
    _, source = _open(store, owner="acme")
    for key, owner in (("k", "other"), ("nope", "acme")):
        with pytest.raises(NotFoundError) as info:
            store.get(key, owner)
        assert info.value.message == "no such stream: unknown, expired, or not yours"
    assert store.get("k", "acme").owner == "acme"
    await store.close()
    assert source.closed.is_set()


async def test_over_max_streams_the_oldest_finished_go_first_and_live_ones_stay() -> None:
    store = _store(max_streams=2)
    _, live = _open(store, "live")
    _, old = _open(store, "old")
    old.finish()
    await asyncio.wait_for(old.closed.wait(), 1)
    await _settle()
    _open(store, "new")  # over the bound: "old" (finished) goes, "live" stays
    assert len(store) == 2
    with pytest.raises(NotFoundError):
        store.get("old", "acme")
    assert not store.get("live", "acme").done
    _open(store, "newer")  # none finished to drop: live streams are never dropped
    assert len(store) == 3
    await store.close()
    assert live.closed.is_set()


async def test_each_stream_keeps_its_latest_events_and_a_resume_from_before_404s() -> None:
    store = _store(max_events_per_stream=16)
    stream, source = _open(store, grace_s=5)
    source.put(*(b"%d" % i for i in range(40)), b"[DONE]")
    source.finish()
    got = await _read(stream, None)  # a reader keeping up sees every event
    assert [seq for seq, _ in got] == list(range(41))
    await _settle()
    assert stream.first_seq == 41 - 16
    with pytest.raises(NotFoundError) as info:
        store.get("k", "acme", after=5)
    assert info.value.to_openai()["error"]["code"] == "stream_events_gone"
    assert (await _read(store.get("k", "acme", after=30), after=30))[0] == (31, b"31")
    await store.close()


async def test_the_producer_waits_for_a_slow_reader_and_for_a_dropped_one() -> None:
    store = _store(max_events_per_stream=16)  # stays at most 14 events ahead
    stream, source = _open(store, grace_s=5)
    source.put(*(b"%d" % i for i in range(100)))
    items = stream.follow(None, keepalive_s=5)
    # an event handed out counts as read once the reader asks for the next one
    assert await anext(items) == (0, b"0")
    await asyncio.sleep(0.05)
    assert stream.next_seq == 14  # backpressure: not 100
    assert await anext(items) == (1, b"1")
    await _settle()
    assert stream.next_seq == 1 + 14
    await items.aclose()  # the reader drops: the producer keeps what a resume needs
    await asyncio.sleep(0.05)
    assert stream.next_seq == 1 + 14 and stream.first_seq == 0
    resumed = store.get("k", "acme", after=0)
    assert await _read(resumed, after=0, count=30) == [(i, b"%d" % i) for i in range(1, 31)]
    await store.close()


async def test_a_producer_held_back_past_the_stall_limit_ends_the_stream_and_closes() -> None:
    store = _store(max_events_per_stream=16)
    stream, source = _open(store, grace_s=5, stall_timeout_s=0.2)
    source.put(*(b"%d" % i for i in range(100)))
    items = stream.follow(None, keepalive_s=5)
    assert await anext(items) == (0, b"0")  # then the reader reads nothing
    await asyncio.sleep(0.1)
    assert not source.closed.is_set()  # held back, not yet past the limit
    await asyncio.wait_for(source.closed.wait(), 2)  # past it: the generation is freed
    got = [item async for item in items if item is not None]
    assert [seq for seq, _ in got] == list(range(1, 15))  # what was made is still there
    error = json.loads(got[-1][1])["error"]
    assert error["code"] == "reader_stalled" and "0.2 s" in error["message"]
    assert stream.done and source.produced < 100
    await store.close()


async def test_events_ready_at_open_are_there_before_the_producer_runs() -> None:
    store = _store()
    source = Source()
    stream = store.open(
        "k", "acme", source.events(), close=source.close, grace_s=0, first=[b"a", b"b"]
    )
    assert stream.next_seq == 2 and source.produced == 0  # no task has run yet
    batches = stream.follow_batches(None, keepalive_s=5)
    assert await anext(batches) == [(0, b"a"), (1, b"b")]  # at once, in one batch
    source.put(b"c")
    source.finish()
    assert [b async for b in batches] == [[(2, b"c")]]
    await store.close()


async def test_a_follow_ends_as_a_watcher_that_left_once_its_client_is_gone() -> None:
    store = _store()
    stream, source = _open(store, grace_s=0)
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    batches = stream.follow_batches(None, keepalive_s=5, until=gone)
    source.put(b"a")
    assert await anext(batches) == [(0, b"a")]
    waiting = asyncio.ensure_future(anext(batches))  # waits for the next event
    await _settle()
    gone.set_result(None)  # the client disconnected
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(source.closed.wait(), 1)  # no grace: the generation is cancelled
    assert stream.watchers == 0
    await store.close()


async def test_close_cancels_every_producer_and_forgets_every_stream() -> None:
    store = _store()
    sources = [_open(store, f"s{i}", grace_s=60)[1] for i in range(3)]
    await _settle()
    await store.close()
    assert all(s.closed.is_set() for s in sources)
    assert len(store) == 0


async def test_a_producer_cancelled_before_it_ran_still_closes() -> None:
    store = _store()
    stream, source = _open(store, grace_s=0)
    stream.cancel()  # before the producer task's first step
    await asyncio.wait_for(source.closed.wait(), 1)
    await _settle()
    assert stream.done
    await store.close()


async def test_a_stream_whose_producer_was_cancelled_is_freed_once_forgotten() -> None:
    """A producer cancelled (its client gone) ends holding its ``CancelledError``, whose
    traceback holds the frame that holds the stream: the stream lets go of its ended
    producer, so it is freed when the store forgets it, not at the collector's next pass."""
    store = _store()
    stream, source = _open(store, grace_s=0)
    source.put(b"x")
    await _settle()
    gc.disable()  # only reference counting frees anything here
    try:
        stream.cancel()
        await asyncio.wait_for(source.closed.wait(), 1)
        await _settle()
        assert stream.done
        freed = weakref.ref(stream)
        del stream
        await store.close()  # forgets it
        assert freed() is None
    finally:
        gc.enable()


async def test_an_idle_follower_leaves_no_waiter_behind_each_keepalive() -> None:
    store = _store()
    stream, source = _open(store, grace_s=5)
    items = stream.follow(None, keepalive_s=0.01)
    for _ in range(20):  # twenty keep-alives on an idle stream
        assert await anext(items) is None
    assert len(stream._waiters) <= 1  # at most the one waiting now
    source.put(b"x")
    assert await anext(items) == (0, b"x")
    await items.aclose()
    await store.close()


async def test_a_stream_lets_in_at_most_max_readers_counting_from_get() -> None:
    """Resumes are counted from ``get`` on, before they follow: a burst of them checked
    together cannot pass the limit; one that leaves makes room for the next."""
    from quantroute.errors import RateLimitError

    store = _store(max_readers=3)
    stream, source = _open(store, grace_s=5.0)
    first = asyncio.create_task(_read(stream, None))  # the response that started it
    await _settle()
    assert stream.watchers == 1
    let_in = [store.get("k", "acme") for _ in range(2)]  # none follows yet
    with pytest.raises(RateLimitError, match="3 readers") as info:
        store.get("k", "acme")
    assert info.value.retry_after_s == 1.0 and info.value.status == 429

    async def one(s: Stream) -> tuple[int, bytes] | None:
        async with contextlib.aclosing(s.follow(None, keepalive_s=5)) as events:
            async for item in events:
                return item  # and leaves, as a response that ends does
        return None

    readers = [asyncio.create_task(one(s)) for s in let_in]
    await _settle()
    assert stream.watchers == 3
    source.put(b"a")
    assert [await r for r in readers] == [(0, b"a"), (0, b"a")]
    await _settle()  # their follows' inner generators close in a task of the loop's
    assert stream.watchers == 1
    again = store.get("k", "acme")  # room again: only the first watcher follows now
    with pytest.raises(RateLimitError):
        for _ in range(2):
            store.get("k", "acme")
    source.finish()
    assert await first == [(0, b"a")]
    assert await _read(again, None) == [(0, b"a")]


async def test_a_reader_let_in_that_never_follows_stops_counting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantroute.errors import RateLimitError
    from quantroute.resilience import resume

    store = _store(max_readers=1)
    _open(store, grace_s=5.0)
    now = [1000.0]
    monkeypatch.setattr(resume.time, "monotonic", lambda: now[0])
    store.get("k", "acme")  # answered, never read
    with pytest.raises(RateLimitError):
        store.get("k", "acme")
    now[0] += resume.ATTACH_S + 0.1
    store.get("k", "acme")  # the first counts no more

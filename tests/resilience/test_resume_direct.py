"""A watcher's events written where they are appended (``Stream.follow_batches(direct=)``):
only while it is parked and has taken every event before, in order, each event once, the
other watchers and the producer's window as before, keep-alives only when nothing went."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence

from qrtest import StreamSource as Source
from quantroute.config import StreamSettings
from quantroute.resilience.resume import Stream, StreamStore


class Writer:
    """A direct writer that records what it wrote (each event, and the seqs of each write)
    and in which task; ``refuse`` says no to that many calls first."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.calls: list[tuple[int, bytes]] = []
        self.written: list[tuple[int, bytes]] = []
        self.writes: list[list[int]] = []
        self.tasks: set[str] = set()

    def __call__(self, seq: int, datas: Sequence[bytes]) -> bool:
        events = [(seq + i, data) for i, data in enumerate(datas)]
        self.calls += events
        if self.refuse > 0:
            self.refuse -= 1
            return False
        self.written += events
        self.writes.append([s for s, _ in events])
        task = asyncio.current_task()
        self.tasks.add(task.get_name() if task is not None else "")
        return True


def _open(store: StreamStore, first: list[bytes] | None = None) -> tuple[Stream, Source]:
    source = Source()
    stream = store.open(
        "k", "acme", source.events(), close=source.close, grace_s=5, first=first or []
    )
    return stream, source


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


Batches = AsyncGenerator[list[tuple[int, bytes]] | None, None]


async def _rest(batches: Batches, parked: asyncio.Future[object] | None = None) -> list[int]:
    """The seqs handed out from here to the end (``parked``: a read already waiting)."""
    got = []
    if parked is not None:
        try:
            got.append(await parked)
        except StopAsyncIteration:
            return []
    got += [b async for b in batches]
    return [seq for batch in got if isinstance(batch, list) for seq, _ in batch]


async def _first_handed_out(
    store: StreamStore, writer: Writer, keepalive_s: float = 5
) -> tuple[Stream, Source, Batches]:
    """A stream whose first event ("a") a direct watcher has handed out."""
    stream, source = _open(store, first=[b"a"])
    batches = stream.follow_batches(None, keepalive_s=keepalive_s, direct=writer)
    assert await anext(batches) == [(0, b"a")]  # the first: handed out (the head goes with it)
    return stream, source, batches


async def _park(batches: Batches) -> asyncio.Future[object]:
    """The watcher's next read, waiting."""
    parked: asyncio.Future[object] = asyncio.ensure_future(anext(batches))
    await _settle()
    return parked


async def test_events_come_while_the_watcher_is_parked_are_written_in_the_producers_task() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer()
    _stream, source, batches = await _first_handed_out(store, writer)
    parked = await _park(batches)
    source.put(b"b", b"c")
    await _settle()
    assert writer.written == [(1, b"b"), (2, b"c")]
    assert writer.tasks == {"stream:k"}  # the producer's: the watcher was never woken
    assert not parked.done()
    source.finish()
    assert await _rest(batches, parked) == []  # the end wakes it: nothing written twice
    await store.close()


async def test_a_refused_write_leaves_that_event_and_those_after_it_to_the_watcher() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer(refuse=1)
    _stream, source, batches = await _first_handed_out(store, writer)
    parked = await _park(batches)
    source.put(b"b", b"c")  # b is refused: c may not overtake it on the wire
    await _settle()
    assert writer.calls == [(1, b"b")] and writer.written == []
    assert await parked == [(1, b"b"), (2, b"c")]
    parked = await _park(batches)
    source.put(b"d")  # parked again, with everything before it taken
    await _settle()
    assert writer.written == [(3, b"d")]
    source.finish()
    assert await _rest(batches, parked) == []
    await store.close()


async def test_the_other_watchers_get_every_event_as_before() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer()
    stream, source, direct = await _first_handed_out(store, writer)
    seen: list[int] = []

    async def follow_plainly() -> None:
        async for batch in stream.follow_batches(None, keepalive_s=5):
            seen.extend(seq for seq, _ in batch or ())

    plain = asyncio.ensure_future(follow_plainly())
    parked = await _park(direct)
    for seq, item in enumerate((b"b", b"c", b"d"), start=1):
        source.put(item)
        await _settle()
        assert seen == list(range(seq + 1))  # each as it comes, not at the end
    source.finish()
    await plain
    assert [seq for seq, _ in writer.written] == [1, 2, 3]
    assert await _rest(direct, parked) == []
    await store.close()


async def test_events_written_directly_make_room_in_the_producers_window() -> None:
    store = StreamStore(StreamSettings(max_events_per_stream=16))  # 14 ahead at most
    stream, source = _open(store)
    writer = Writer()
    batches = stream.follow_batches(None, keepalive_s=5, direct=writer)
    source.put(*(b"%d" % i for i in range(100)))
    source.finish()
    handed = await _rest(batches)
    # every event exactly once, in order, most of them without a hand-out
    assert sorted(handed + [seq for seq, _ in writer.written]) == list(range(100))
    assert [seq for seq, _ in writer.written] == sorted(seq for seq, _ in writer.written)
    assert len(writer.written) > 50
    await store.close()


async def test_a_keepalive_comes_keepalive_s_after_the_last_write_and_never_before() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer()
    _stream, source, batches = await _first_handed_out(store, writer, keepalive_s=0.5)
    got: list[tuple[float, object]] = []
    came = asyncio.Event()

    async def read() -> None:
        async for batch in batches:
            got.append((time.monotonic(), batch))
            came.set()

    reading = asyncio.ensure_future(read())
    await _settle()  # parked
    for i in range(16):  # 0.8 s of events every 0.05 s: never silent for 0.5 s
        source.put(b"%d" % i)
        await asyncio.sleep(0.05)
    last = time.monotonic() - 0.05
    assert got == [] and len(writer.written) == 16
    await asyncio.wait_for(came.wait(), 2)
    when, item = got[0]
    # its timer ran out twice while the events went; what counts is the last one
    assert item is None and 0.45 <= when - last < 0.65
    source.finish()
    await asyncio.wait_for(reading, 2)
    await store.close()


async def test_a_watcher_woken_but_not_yet_running_does_not_keep_the_others_waiting() -> None:
    """The direct watcher's wait was ended (another client left) and it has not run yet when
    a resume parks and an event comes: the resume is woken for it all the same."""
    store = StreamStore(StreamSettings())
    writer = Writer()
    stream, source, direct = await _first_handed_out(store, writer)
    parked = await _park(direct)
    resumed = asyncio.ensure_future(anext(stream.follow_batches(0, keepalive_s=5)))
    loop = asyncio.get_running_loop()
    loop.call_soon(stream.append, b"b")  # after the resume parks, before the watcher runs
    stream._wake()  # as when a third watcher's client leaves
    assert await asyncio.wait_for(resumed, 1) == [(1, b"b")]
    assert writer.written == [(1, b"b")]
    source.finish()
    assert await _rest(direct, parked) == []  # woken, it hands out nothing written already
    await store.close()


async def test_nothing_is_written_for_a_watcher_that_left() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer()
    stream, source, batches = await _first_handed_out(store, writer)
    parked = await _park(batches)
    parked.cancel()  # its client went while it waited
    await _settle()
    await batches.aclose()
    source.put(b"b")
    await _settle()
    assert writer.calls == [] and stream.next_seq == 2  # kept for a resume, not written
    await store.close()


async def test_a_watcher_that_has_handed_out_nothing_yet_gets_its_first_event_handed_out() -> None:
    """A resume with nothing new: its first event goes through the response (which frames
    the first one apart, with ``retry:``), even after keep-alives; the rest directly."""
    store = StreamStore(StreamSettings())
    stream, source = _open(store, first=[b"a"])
    writer = Writer()
    batches = stream.follow_batches(0, keepalive_s=0.05, direct=writer)  # after "a"
    assert await anext(batches) is None  # idle: a keep-alive, which is no event
    parked = asyncio.ensure_future(anext(batches))
    await _settle()
    source.put(b"b")
    assert await parked == [(1, b"b")] and writer.calls == []
    parked = await _park(batches)
    source.put(b"c")
    await _settle()
    assert writer.written == [(2, b"c")] and not parked.done()
    source.finish()
    assert await _rest(batches, parked) == []
    await store.close()


async def test_events_produced_together_are_written_together() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer()
    stream, source, batches = await _first_handed_out(store, writer)
    parked = await _park(batches)
    source.put(b"b")
    source.put_together(b"c", b"d", b"e")  # a last chunk, the usage, [DONE]
    await _settle()
    assert writer.writes == [[1], [2, 3, 4]]
    assert writer.written == [(1, b"b"), (2, b"c"), (3, b"d"), (4, b"e")]
    assert stream.next_seq == 5 and not parked.done()
    source.finish()
    assert await _rest(batches, parked) == []
    await store.close()


async def test_events_produced_together_are_handed_out_together_when_not_written() -> None:
    store = StreamStore(StreamSettings())
    writer = Writer(refuse=1)
    _stream, source, batches = await _first_handed_out(store, writer)
    parked = await _park(batches)
    source.put_together(b"b", b"c", b"d")  # refused, all three: none may overtake another
    await _settle()
    assert writer.calls == [(1, b"b"), (2, b"c"), (3, b"d")] and writer.written == []
    assert await parked == [(1, b"b"), (2, b"c"), (3, b"d")]
    source.finish()
    assert await _rest(batches) == []
    await store.close()


async def test_events_produced_together_wait_for_room_one_by_one_at_the_windows_edge() -> None:
    """Fourteen ahead at most: of four produced together past that, what fits goes, and
    the rest as the reader moves on, none lost to the window."""
    store = StreamStore(StreamSettings(max_events_per_stream=16))
    stream, source = _open(store)
    batches = stream.follow_batches(None, keepalive_s=5)  # no direct writer: reads in turn
    source.put(*(b"%d" % i for i in range(12)))
    source.put_together(b"12", b"13", b"14", b"15")
    source.finish()
    await _settle()
    assert stream.next_seq == 14  # 0-13: the window's 14 ahead of a reader at 0; 14, 15 wait
    assert await _rest(batches) == list(range(16))
    await store.close()

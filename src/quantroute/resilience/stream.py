"""One resumable stream: its numbered events, the latest kept, and the watchers that
follow them. :class:`~quantroute.resilience.resume.StreamStore` opens each one and runs
its producer (``resilience/resume.py``).

A watcher follows the stream from any event on (:meth:`Stream.follow`): the kept events
after it, then the live rest as it comes, then the end. A stream has at most
``max_readers`` watchers at once: a resume past them is a 429 (each one let in is
counted from :meth:`StreamStore.get <quantroute.resilience.resume.StreamStore.get>` on,
so a flood of resumes cannot pass it together before any of them follows). The producer
never runs further ahead of its slowest reader (or, with none, of where the last one
left) than 7/8 of the events kept: a slow reader holds the generation back instead of
losing events, and the last 1/8 keeps what was in flight when a client dropped. A
producer held back for longer than the stream's ``stall_timeout_s`` gets
:class:`ReaderStalledError` (the reader read nothing for that long). When the last
watcher leaves before the end, the stream waits ``grace_s`` for one to come back and
then cancels its producer. Its secret :attr:`Stream.token` goes to the client that
started it, and a resume that must show it is compared in constant time.

A stream may have a :class:`Replica`: a copy of its events that other gateways resume
from (``cluster/redis_streams.py``). Each event appended is handed to it too, a list
append, and the copy is written later, off this path.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, Protocol

from quantroute.errors import NotFoundError, QuantrouteError
from quantroute.resilience.kept_bytes import KeptBytes

__all__ = ["ATTACH_S", "DirectWrite", "ReaderStalledError", "Replica", "Stream", "token_digest"]

log = logging.getLogger(__name__)

# A stream nobody has watched yet gets this long for its first watcher (the response
# that opened it) before it counts as left: a response that never starts frees its slot.
ATTACH_S = 5.0

DirectWrite = Callable[[int, Sequence[bytes]], bool]
"""Writes events ``seq``, ``seq + 1``, ... (their data, in order) to a watcher's client now,
in one write, or says it may not (``False``: none written)."""


def token_digest(token: str) -> str:
    """What a copy of a stream keeps of its token (sha256, hex): enough to check one shown."""
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


class Replica(Protocol):
    """A copy of one stream's events, for other gateways (``cluster/redis_streams.py``).

    The stream calls it as it changes, in its own task: each call is cheap and never waits
    (the copy is written later, off the append's path). A copy that cannot keep up loses
    events of its own, never the stream's."""

    def add(self, seq: int, data: bytes) -> None:
        """The event ``seq`` was appended."""

    def extend(self, seq: int, datas: Sequence[bytes]) -> None:
        """The events ``seq``, ``seq + 1``, ... were appended together."""

    def trimmed(self, first_seq: int) -> None:
        """The stream keeps only the events from ``first_seq`` on now."""

    def end(self, next_seq: int) -> None:
        """The stream ended; its last event was ``next_seq - 1``."""

    def forget(self) -> None:
        """The stream was shed (``streams.max_bytes``, ``max_streams``): forget the copy."""


class ReaderStalledError(QuantrouteError):
    """The client stopped reading its stream for longer than the limit."""

    code = "reader_stalled"


class Stream:
    """One stream's numbered events (``seq`` 0, 1, ...), the latest ``max_events`` kept."""

    def __init__(
        self,
        key: str,
        owner: str,
        headers: Mapping[str, str],
        max_events: int,
        grace_s: float,
        stall_timeout_s: float | None = None,
        budget: KeptBytes | None = None,
        start: int = 0,
    ):
        self.key = key
        self.owner = owner
        self.headers = dict(headers)  # of the response that started it, for resumes
        # The secret a resume shows where the owner alone says nothing (an open API):
        # only the client that started the stream has it (a response header).
        self.token = secrets.token_hex(16)
        self.next_seq = start  # the seq the next event gets (a copy read from seq ``start``)
        self.done = False
        self.ended_at: float | None = None  # loop time of the end
        self._events: deque[bytes] = deque()
        self._max_events = max_events
        self._budget = budget or KeptBytes()  # the store's, all streams together
        self._waiters: list[asyncio.Future[None]] = []  # watchers waiting for an event
        # The producer stays this many events ahead of the slowest reader at most; the rest
        # of the window keeps events that were in flight when a client dropped.
        self._ahead = max(1, max_events - max_events // 8)
        self._cursors: list[list[int]] = []  # each watcher's next seq
        self._left_at = start  # where the last watcher to leave was: a resume starts near it
        self._moved = asyncio.Event()  # a reader moved on (or left): the producer may go on
        self._grace_s = grace_s
        self._stall_timeout_s = stall_timeout_s  # the longest the producer waits for room
        self._watchers = 0
        self._let_in: deque[float] = deque()  # monotonic times of resumes not yet following
        self._producer: asyncio.Task[None] | None = None
        self._started = False  # the producer ran its first step
        self._stopping = False  # cancelled before that: it stops as soon as it runs
        self._reaper: asyncio.TimerHandle | None = None
        self._expiry: asyncio.TimerHandle | None = None
        # The parked watcher whose events may be written where they are appended: its
        # writer, its cursor and the future it waits on (see ``follow_batches``).
        self._direct: tuple[DirectWrite, list[int], asyncio.Future[None]] | None = None
        self._written_at = 0.0  # monotonic time of its last direct write
        self._replica: Replica | None = None  # the copy other gateways resume from

    @property
    def first_seq(self) -> int:
        """The seq of the oldest event still kept."""
        return self.next_seq - len(self._events)

    @property
    def watchers(self) -> int:
        return self._watchers

    def let_in(self, limit: int, now: float) -> bool:
        """Count one more reader from now on, if the stream has fewer than ``limit``: its
        watchers, and the readers let in within ``ATTACH_S`` that do not follow yet."""
        let_in = self._let_in
        while let_in and let_in[0] <= now - ATTACH_S:  # let in, and never came to follow
            let_in.popleft()
        if self._watchers + len(let_in) >= limit:
            return False
        let_in.append(now)
        return True

    def opens_with(self, token: str | None, required: bool) -> bool:
        """Whether a resume that shows ``token`` may follow: no token passes unless one is
        ``required``; a token passes if it is this stream's (compared in constant time)."""
        if token is None:
            return not required
        presented = token.encode("utf-8", "replace")
        return hmac.compare_digest(presented, self.token.encode())

    def keeps_after(self, after: int | None) -> bool:
        """Whether every event after ``after`` (``None``: all) is still kept."""
        return (-1 if after is None else after) + 1 >= self.first_seq

    async def room(self) -> None:
        """Returns when the slowest reader (or, with none, the last to leave) is close enough
        that one more event loses nothing it still needs: backpressure on the generation.
        Raises :class:`ReaderStalledError` after ``stall_timeout_s`` of waiting."""
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                while not self.done and self.next_seq - self._floor() >= self._ahead:
                    self._moved.clear()
                    await self._moved.wait()
        except TimeoutError:
            raise ReaderStalledError(
                f"the client read nothing for {self._stall_timeout_s:g} s; the stream was cut"
            ) from None

    def room_for(self, n: int) -> bool:
        """Whether ``n`` more events may be appended now without waiting for :meth:`room`."""
        return not self.done and self.next_seq + n - self._floor() <= self._ahead

    def _floor(self) -> int:
        cursors = self._cursors
        if len(cursors) == 1:  # the common case: the response that started it
            return cursors[0][0]
        return min(c[0] for c in cursors) if cursors else self._left_at

    def append(self, data: bytes) -> None:
        if self.done:
            return
        events = self._events
        events.append(data)
        seq = self.next_seq
        self.next_seq = seq + 1
        budget = self._budget  # counted inline (once per token): an add and a compare
        budget.used += len(data)
        if len(events) > self._max_events or budget.used > budget.limit:
            self._bound()
        replica = self._replica
        if replica is not None:
            replica.add(seq, data)
        self._hand(seq, (data,))

    def extend(self, datas: Sequence[bytes]) -> None:
        """Append ``datas`` as that many events, at once: a watcher they are written to
        where they are appended gets them in one write (a stream's last chunk, its usage
        and ``[DONE]``). The caller makes room for all of them first (:meth:`room_for`)."""
        if self.done or not datas:
            return
        events = self._events
        events.extend(datas)
        seq = self.next_seq
        self.next_seq = seq + len(datas)
        budget = self._budget
        budget.used += sum(map(len, datas))
        if len(events) > self._max_events or budget.used > budget.limit:
            self._bound()
        replica = self._replica
        if replica is not None:
            replica.extend(seq, datas)
        self._hand(seq, datas)

    def _bound(self) -> None:
        """Past ``max_events``, or the store past its bytes: forget what is over."""
        if len(self._events) > self._max_events:
            self.trim(len(self._events) - self._max_events)
        if self._budget.used > self._budget.limit:
            self._budget.shed()

    def trim(self, n: int) -> int:
        """Forget the oldest ``n`` events kept (fewer if it keeps fewer); the bytes freed.
        A reader, or a resume, from before them gets ``stream_events_gone``."""
        events = self._events
        freed = 0
        for _ in range(min(n, len(events))):
            freed += len(events.popleft())
        self._budget.used -= freed
        if self._replica is not None:
            self._replica.trimmed(self.first_seq)
        return freed

    def read_by_all(self) -> int:
        """How many of the oldest events kept every reader following now has passed (none
        without one: a client that left may come back for what was in flight)."""
        if not self._cursors:
            return 0
        return max(0, min(self._floor(), self.next_seq) - self.first_seq)

    def _leave_budget(self) -> None:
        """No longer one of the store's: its bytes stop counting there."""
        self._budget.used -= self.kept_bytes
        self._budget = KeptBytes()

    @property
    def kept_bytes(self) -> int:
        """Bytes of the events kept (counted when asked: the store counts them all)."""
        return sum(map(len, self._events))

    @property
    def kept_events(self) -> int:
        return len(self._events)

    def wake(self) -> None:
        """Wake every watcher (one behind what is kept learns it)."""
        self._wake()

    def _hand(self, seq: int, datas: Sequence[bytes]) -> None:
        """Write the events from ``seq`` on for the parked direct watcher, or wake them."""
        direct = self._direct
        if direct is not None:
            write, cursor, parked = direct
            # written here only when every event before them was: the order on the wire
            if cursor[0] == seq and write(seq, datas):
                cursor[0] = self.next_seq  # read: parked, this watcher is nobody's floor
                self._written_at = time.monotonic()  # its keep-alive counts from here
                waiters = self._waiters
                if waiters and (len(waiters) > 1 or waiters[0] is not parked):
                    self._wake(but=parked)  # the other watchers see it as before
                return
        self._wake()

    def _wake(self, but: asyncio.Future[None] | None = None) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if waiter is but:
                self._waiters.append(waiter)
            elif not waiter.done():
                waiter.set_result(None)

    def end(self, now: float) -> None:
        self.done = True
        self.ended_at = now
        self._cancel_reaper()
        if self._replica is not None:
            self._replica.end(self.next_seq)
        self._wake()

    async def follow(
        self, after: int | None, keepalive_s: float | None = None
    ) -> AsyncGenerator[tuple[int, bytes] | None, None]:
        """``(seq, data)`` of every event after ``after`` (``None``: from the first), live
        ones as they come, until the end; ``None`` after ``keepalive_s`` idle."""
        async for batch in self.follow_batches(after, keepalive_s, max_batch=1):
            yield None if batch is None else batch[0]

    async def follow_batches(
        self,
        after: int | None,
        keepalive_s: float | None = None,
        *,
        max_batch: int = 1 << 30,
        until: asyncio.Future[Any] | None = None,
        direct: DirectWrite | None = None,
    ) -> AsyncGenerator[list[tuple[int, bytes]] | None, None]:
        """Like :meth:`follow`, but the events kept and not yet seen (up to ``max_batch``) at
        once: one when the reader keeps up, more when it lags or resumes (so they are
        written together). Ends early, as a watcher that left, once ``until`` is done (its
        client disconnected).

        With ``direct``, an event appended while this watcher is parked, having taken
        every event before it and handed out its first batch (a response's first event
        is framed apart), is written by ``direct(seq, data)`` in the appending task
        and not handed out here (the stream's one such watcher at a time): no task wake
        per event while the reader keeps up. A write it refuses (``False``) leaves the
        event to be handed out as usual, and the events after it with it."""
        seq = 0 if after is None else after + 1
        cursor = [seq]
        self._attach(cursor)
        loop = asyncio.get_running_loop()
        handed = False  # a batch went out: the response's first event (``retry:``) is past
        silent_s = keepalive_s or 0.0  # the next wait's keep-alive timer
        if until is not None:
            until.add_done_callback(self._woken)
        try:
            while until is None or not until.done():
                if seq < self.first_seq:  # this watcher fell behind what is kept
                    raise NotFoundError(
                        "the stream's events after that id are no longer kept",
                        code="stream_events_gone",
                    )
                if seq < self.next_seq:
                    # handed out, the batch counts as read once the reader asks for more
                    cursor[0] = seq
                    self._moved.set()
                    first = self.first_seq
                    end = min(self.next_seq, seq + max_batch)
                    batch = [(s, self._events[s - first]) for s in range(seq, end)]
                    seq = end
                    handed = True
                    silent_s = keepalive_s or 0.0
                    yield batch
                    continue
                if cursor[0] != seq:
                    cursor[0] = seq
                    self._moved.set()
                if self.done:
                    return
                # Wait for the next event: a future, not a task per wait (the hot path).
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters.append(waiter)
                timer = None
                if keepalive_s is not None:
                    timer = loop.call_later(silent_s, _time_out, waiter)
                if direct is not None and handed and self._direct is None:
                    self._direct = (direct, cursor, waiter)
                timed_out = False
                try:
                    await waiter
                except TimeoutError:
                    timed_out = True
                finally:
                    if self._direct is not None and self._direct[2] is waiter:
                        self._direct = None  # awake: what comes now is handed out in order
                    if timer is not None:
                        timer.cancel()
                    if waiter in self._waiters:  # timed out or cancelled: not woken
                        self._waiters.remove(waiter)
                written = cursor[0] != seq  # events written for it where they were appended
                seq = cursor[0]
                silent_s = keepalive_s or 0.0
                if written:  # not silent: a keep-alive is due that long after the last write
                    silent_s = max(0.0, self._written_at + silent_s - time.monotonic())
                elif timed_out:
                    yield None
        finally:
            if until is not None:
                until.remove_done_callback(self._woken)
            self._detach(cursor)  # sync: this may run inside a cancelled scope

    def _woken(self, _: object) -> None:
        self._wake()  # a watcher's client left: it stops waiting (the others wait again)

    # -- watchers and the grace ----------------------------------------------------

    def _attach(self, cursor: list[int]) -> None:
        self._watchers += 1
        if self._let_in:  # a reader let in now follows (which one does not matter)
            self._let_in.popleft()
        self._cursors.append(cursor)
        self._cancel_reaper()
        self._moved.set()

    def _detach(self, cursor: list[int]) -> None:
        self._watchers -= 1
        self._cursors.remove(cursor)
        self._moved.set()
        if self._watchers == 0:
            self._left_at = cursor[0]
        if self._watchers == 0 and not self.done:
            if self._grace_s <= 0:
                self.cancel()
            else:
                self._arm(self._grace_s)

    def _arm(self, delay_s: float) -> None:
        self._cancel_reaper()
        self._reaper = asyncio.get_running_loop().call_later(delay_s, self._reap)

    def _reap(self) -> None:
        self._reaper = None
        if self._watchers == 0 and not self.done:
            log.info("stream %s: nobody came back; cancelling its generation", self.key)
            self.cancel()

    def _cancel_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    def _produced(self, _task: asyncio.Task[None]) -> None:
        # forgotten once done: a producer cancelled (its client left) holds its error, whose
        # traceback holds the frame that holds this stream, a cycle for the collector
        self._producer = None

    def cancel(self) -> None:
        """Stop the producer (its generation is closed; the stream ends with an error)."""
        if not self._started:
            self._stopping = True  # a task cancelled before its first step runs no finally
        elif self._producer is not None and not self._producer.done():
            self._producer.cancel()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())

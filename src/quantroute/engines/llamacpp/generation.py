"""A llama.cpp generation as the gateway reads it: :class:`Generation`, one ``gen``
command's events (a push source, ``engines.base.PushSource``), and the worker's
errors as the gateway's (:func:`worker_error`).

The engine's reader task (:mod:`.engine`) decodes the worker's events
(:mod:`.wire`) and puts each into its request's :class:`~quantroute.engines.inbox.Inbox`:
a plain token already as a :class:`TokenEvent`, anything else as its wire event, or
an exception (a dead worker, a timeout). A generation turns those into engine events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from quantroute.engines.base import EngineEvent, TokenEvent
from quantroute.engines.inbox import Inbox
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.exchange_timer import ExchangeTimer
from quantroute.errors import (
    ContextLengthExceededError,
    DeviceOutOfMemoryError,
    EngineError,
    InvalidRequestError,
)

if TYPE_CHECKING:
    from quantroute.engines.llamacpp.engine import LlamaCppEngine

Item = TokenEvent | wire.Event | BaseException
"""What an exchange's inbox holds: a token, another event of the worker's, a failure."""

# A request's events waiting for its reader: at the high mark the worker pauses its
# sequence (it keeps its slot, decodes nothing); at the low mark it resumes. A slow
# reader so costs the gateway at most this many events, never an unbounded buffer.
STREAM_HIGH_WATER = 64
STREAM_LOW_WATER = 16


class Generation:
    """One ``gen`` command's events, read one at a time (``async for``, ``anext``: the
    command is sent at the first read) or, once it is open, as a push source: every event
    that has come (:meth:`take_ready`), and ``notify`` called from the engine's reader
    task when one comes while nothing waits for it. A stream read this way needs no task
    of its own between the worker's pipe and its consumer (``api/run.py``: ``Run``).

    Either way: an ``err`` event, a dead worker or ``gen_idle_timeout_s`` without an event
    while the reader waits raises ``EngineError``; a reader that leaves before the end
    (:meth:`aclose`) cancels the command; one that lets ``STREAM_HIGH_WATER`` events pile
    up pauses the sequence in the worker until it has taken them."""

    def __init__(self, engine: LlamaCppEngine, command: wire.Generate, *, counted: bool):
        self._engine = engine
        self._command = command
        self._rid = command.id
        self._counted = counted  # a start counted in the prompt cache's figures (not a warm-up)
        self._inbox: Inbox[Item] | None = None
        self._timer: ExchangeTimer | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._done = False  # its last event came (or its error): the worker owes nothing
        self._closed = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> EngineEvent:
        inbox = self._inbox if self._inbox is not None else await self._open()
        timer = self._timer
        assert timer is not None
        while not self._closed:
            if inbox.items:
                item = inbox.items.popleft()  # the common case under load
            else:
                timer.waiting()
                try:
                    item = await inbox.get()
                except BaseException:  # cancelled: over, as a generator it would be
                    self._finish()
                    raise
                timer.got()
            event = self._event(item)
            if inbox.qsize() <= STREAM_LOW_WATER:
                self._resume()
            if event is not None:
                return event
        raise StopAsyncIteration

    def has_ready(self) -> bool:
        return bool(self._inbox is not None and self._inbox.items and not self._closed)

    def take_ready(self, tokens_only: bool = False) -> list[EngineEvent]:
        """Every event that has come and was not read yet, without waiting (its end
        included), or with ``tokens_only`` the plain tokens before anything else. An error
        raises, after the events before it were taken."""
        inbox, timer = self._inbox, self._timer
        if inbox is None or timer is None or self._closed:
            return []
        items = inbox.items
        events: list[EngineEvent] = []
        while items and not self._closed:
            item = items[0]
            if timer.expired is None:
                if type(item) is TokenEvent:  # the common case: a plain token
                    items.popleft()
                    events.append(item)
                    continue
                if tokens_only:
                    break
                failing = isinstance(item, BaseException | wire.Error)
            else:
                failing = True
            if failing and (events or tokens_only):
                break  # raised at the next call, after these are handed out
            event = self._event(items.popleft())
            if event is not None:
                events.append(event)
        if events:
            timer.got()
        if not items:
            timer.waiting()  # what comes next, it waits for (its idle clock runs)
            self._resume()
        return events

    @property
    def notify(self) -> Callable[[], None] | None:
        return None if self._inbox is None else self._inbox.notify

    @notify.setter
    def notify(self, callback: Callable[[], None] | None) -> None:
        if self._inbox is not None:  # a push source once it is open (its first read)
            self._inbox.notify = None if self._closed else callback

    async def aclose(self) -> None:
        self._finish()

    def __del__(self) -> None:
        # Dropped unread and unclosed (a caller that broke out of its loop): cancelled in
        # the worker, as an async generator's finalizer would do.
        if not self._closed:
            with contextlib.suppress(Exception):
                self._finish()

    async def _open(self) -> Inbox[Item]:
        engine = self._engine
        idle_s = engine._options.gen_idle_timeout_s
        self._proc, inbox, timer = engine._enter(self._rid, idle_s, None)
        self._inbox, self._timer = inbox, timer
        try:
            await engine._send(self._command, timer.wait_s())
        except BaseException:
            self._finish()
            raise
        return inbox

    def _event(self, item: Item) -> EngineEvent | None:
        """The event of one item (``None`` for one no reader sees); raises for an error.
        The generation is over after its end or an error."""
        engine = self._engine
        timer = self._timer
        assert timer is not None and self._proc is not None
        if timer.expired is not None:  # the worker may still answer: it is cancelled
            self._finish()
            raise engine._timed_out(self._proc, timer.expired, timer.expired)
        if isinstance(item, TokenEvent):
            return item
        if isinstance(item, wire.Started):
            start = item.event()
            if self._counted:
                engine._cache_stats.add(start)
            return start
        if isinstance(item, wire.Finished):
            engine._supervisor.note_healthy()  # a finished generation: a healthy run
            finish = item.event(held=self._rid in engine._held)  # before _finish forgets it
            self._done = True
            self._finish()
            return finish
        if isinstance(item, BaseException | wire.Error):  # nothing more will come
            self._done = True
            self._finish()
            if isinstance(item, BaseException):
                raise item
            raise worker_error(engine.name, item)
        return None

    def _resume(self) -> None:
        engine = self._engine
        if self._rid in engine._paused and not self._closed:
            engine._paused.discard(self._rid)
            engine._post(wire.Resume(self._rid))

    def _finish(self) -> None:
        """Over, however it ended: forget it; cancel it in the worker unless it ended there."""
        if self._closed:
            return
        self._closed = True
        if self._inbox is None or self._timer is None or self._proc is None:
            return  # never sent
        self._engine._leave(self._rid, self._inbox, self._timer, self._proc, done=self._done)


_CLIENT_ERRORS = {"invalid_grammar": "response_format", "grammar_too_long": "max_tokens"}


def worker_error(branch: str, event: wire.Error) -> Exception:
    """The worker's ``err`` as the gateway's error: the request's own fault (a context
    too short, a grammar) or the branch's."""
    code = event.code
    if code == "context_length_exceeded":
        return ContextLengthExceededError(
            prompt_tokens=event.prompt_tokens or 0,
            max_tokens=event.max_tokens or 0,
            n_ctx=event.n_ctx or 0,
            at_least=event.at_least,
        )
    if code in _CLIENT_ERRORS:  # the request's own fault: a 400, not the branch's
        return InvalidRequestError(event.message, param=_CLIENT_ERRORS[code])
    if code == "device_out_of_memory":
        return DeviceOutOfMemoryError(f"branch {branch}: {event.message or 'out of memory'}")
    return EngineError(
        f"branch {branch}: {event.message or 'generation failed'}",
        code=code if code != "engine_error" else None,
    )

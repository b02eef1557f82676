"""The :class:`Run` of a job on one branch: its choices' events merged as they come, and
:class:`Tick` (idle)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from quantroute.api.jobs import Job
from quantroute.engines.base import (
    EngineEvent,
    FinishEvent,
    PushSource,
    TokenEvent,
    is_push_source,
)
from quantroute.errors import EngineError
from quantroute.routing.table import Branch

RUN_BUFFER_EVENTS = 64  # a run's events waiting for its reader, per choice


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing happened for a keep-alive interval."""


class Run:
    """A job started on one branch: merged events of its choices.

    ``pending[i]`` holds the events of choice ``i`` that the service already read
    while deciding to commit to this branch (its start and first token); they
    come out first, or are taken at once by :meth:`take_pending`. ``on_done(run, ok)``
    is told once, when the run closes: ``ok`` is ``True`` when every choice finished,
    ``False`` when the engine failed one, ``None`` when it was cut short (the client
    left, or stopped reading).

    :meth:`batches` (a stream's producer in the stream store) hands out what is ready
    together, together: a reader that lags gets one chunk for the tokens that piled up.
    Where every engine stream is a push source (``engines.base.PushSource``: llama.cpp's),
    the reader takes what came from them in its own task, woken by the engine's reader
    task, and a consumer set as ``inline`` (a stream's chunks, ``sse.write_inline``) is
    handed plain tokens in that task itself while the reader waits: between the worker's
    pipe and the client's response, no task of its own. Other engine streams are read by
    a pump task each into a bounded buffer (``RUN_BUFFER_EVENTS`` per choice).
    :meth:`events` with one choice and no keep-alives (a whole response's collector, which
    reads as fast as events come) reads it straight from its engine stream in the
    reader's task: no pump, no buffer.
    """

    def __init__(
        self,
        job: Job,
        branch: Branch,
        streams: list[AsyncIterator[EngineEvent]],
        prompt_tokens: list[int],
        on_finished: Callable[[Run, list[int]], None] | None = None,
        *,
        cached_tokens: list[int] | None = None,
        drafted: bool = False,
        pending: list[list[EngineEvent]] | None = None,
        on_done: Callable[[Run, bool | None], None] | None = None,
        opened: float | None = None,
    ):
        self.job = job
        self.opened = opened  # perf_counter when the engine got it (past the admission queue)
        self.held = False  # the engine held a choice for its slow reader (FinishEvent.held)
        self.branch = branch
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens or [0] * len(prompt_tokens)  # from prompt caches
        self.drafted = drafted  # its engine speculates for it (StartEvent.drafted)
        self._streams = streams
        self._pending = pending or [[] for _ in streams]
        self._on_finished = on_finished
        self._on_done = on_done
        self._tokens: list[int] = []  # of choice 0, for the drift monitor
        self._pieces: list[str] = []  # its text where the engine gave no ids (a remote)
        # Bounded: at most RUN_BUFFER_EVENTS events per choice wait for the reader (``_room``);
        # then the pumps stop, their engine streams fill, and the engine pauses the sequences
        # in the worker (high and low watermarks there). A choice's end or error always fits.
        # A deque and one future, not an asyncio.Queue and a Semaphore: this is per token.
        self._ready: deque[tuple[int, EngineEvent] | BaseException | None] = deque()
        self._reader: asyncio.Future[None] | None = None  # the reader, waiting for an event
        self._room = RUN_BUFFER_EVENTS * max(1, len(streams))
        self._drained = asyncio.Event()  # the reader took events: a full pump may go on
        self._pumps: list[asyncio.Task[None]] = []
        self._push: list[PushSource] = []  # the streams, when every one is a push source
        # Plain tokens handed over in the engine's task (see ``inline``); what ``inline``
        # refused, or an error it raised, waits here for the reader's task
        self.inline: Callable[[list[tuple[int, EngineEvent]]], bool] | None = None
        self._carry: list[tuple[int, EngineEvent]] = []
        self._carry_error: Exception | None = None
        self._finished = 0
        self._sent = [0] * len(streams)  # per choice: tokens it sent; -1 once it finished
        # prompt (once per prompt) and completion tokens; a choice cut short: those it sent
        self.usage_tokens = 0
        self._failed = False
        self._closed = False

    @property
    def finished(self) -> bool:
        """Every choice has finished: the events read so far hold its last."""
        return self._finished == len(self._streams)

    async def events(
        self, keepalive_s: float | None = None
    ) -> AsyncIterator[tuple[int, EngineEvent] | Tick]:
        """Every choice's events, interleaved as they come; ``Tick`` when idle."""
        if len(self._streams) == 1 and keepalive_s is None:
            try:
                async with contextlib.aclosing(self._direct()) as events:
                    async for event in events:
                        yield 0, event
            finally:
                await self.close()
            return
        async for batch in self.batches(keepalive_s):
            if isinstance(batch, Tick):
                yield batch
            else:
                for item in batch:
                    yield item

    def take_pending(self) -> list[tuple[int, EngineEvent]]:
        """The events already read (see the class docstring), counted as they would be
        when read, now: a stream's first chunks are written without waiting for a task."""
        taken = [(i, event) for i, events in enumerate(self._pending) for event in events]
        self._pending = [[] for _ in self._streams]
        for index, event in taken:
            self._note(index, event)
        return taken

    def batches(
        self, keepalive_s: float | None = None
    ) -> AsyncGenerator[list[tuple[int, EngineEvent]] | Tick, None]:
        """Like :meth:`events`, but each time every event that is ready, in order: one
        when the reader keeps up, more when it lags (so it can write them at once)."""
        if all(is_push_source(stream) for stream in self._streams):
            return self._pushed(keepalive_s)
        return self._pumped(keepalive_s)

    async def _pumped(
        self, keepalive_s: float | None
    ) -> AsyncGenerator[list[tuple[int, EngineEvent]] | Tick, None]:
        """:meth:`batches` from engine streams read by a pump task each, into the buffer."""
        self._pumps = [
            asyncio.create_task(self._pump(i, s), name=f"pump:{self.job.id}:{i}")
            for i, s in enumerate(self._streams)
        ]
        remaining = len(self._pumps)
        ready = self._ready
        try:
            while remaining:
                if not ready and not await self._woken(keepalive_s):
                    yield Tick()
                    continue
                batch: list[tuple[int, EngineEvent]] = []
                while ready:
                    item = ready.popleft()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        if batch:
                            yield batch  # what came before the error still goes out
                        raise item
                    else:
                        batch.append(item)
                if batch:
                    self._room += len(batch)
                    self._drained.set()
                    yield batch
        finally:
            await self.close()

    async def _pushed(
        self, keepalive_s: float | None
    ) -> AsyncGenerator[list[tuple[int, EngineEvent]] | Tick, None]:
        """:meth:`batches` from engine streams that are push sources: each is told to wake
        this reader when an event comes, and the reader takes every event that has come,
        in its own task. No pump task and no buffer between the engine's reader and this
        one; a reader that lags leaves the events in the engine's inbox, where they pause
        the sequence in the worker past its high-water mark."""
        streams = self._push = [s for s in self._streams if is_push_source(s)]
        batch = self.take_pending()
        for stream in streams:
            stream.notify = self._wake
        try:
            while True:
                if self._carry:  # taken in the engine's task, noted there
                    batch.extend(self._carry)
                    self._carry = []
                if self._carry_error is not None:
                    error, self._carry_error = self._carry_error, None
                    if batch:
                        yield batch
                    raise error
                try:
                    self._take(batch)
                except Exception as exc:
                    self._failed = self._failed or isinstance(exc, EngineError)
                    if batch:
                        yield batch  # what came before the error still goes out
                    raise
                if batch:
                    yield batch
                    batch = []
                    continue
                if all(sent < 0 for sent in self._sent):
                    return
                if not await self._woken(keepalive_s):
                    yield Tick()
        finally:
            for stream in streams:
                stream.notify = None
            await self.close()

    async def _woken(self, keepalive_s: float | None) -> bool:
        """Wait until an event wakes the reader (``_put``, ``_wake``); ``False`` when
        ``keepalive_s`` passed first."""
        loop = asyncio.get_running_loop()
        reader = self._reader = loop.create_future()
        timer = None if keepalive_s is None else loop.call_later(keepalive_s, _time_out, reader)
        try:
            await reader
            return True
        except TimeoutError:
            return False
        finally:
            self._reader = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        """A push source has an event (called in the engine's task). A reader waiting for
        one is woken; but where plain tokens are all that came and ``inline`` takes them
        (a streamed response's chunks, rendered into its stream), they are handed over here
        and the reader sleeps on: one task fewer between the worker and the client."""
        reader = self._reader
        if reader is None or reader.done():
            return  # not waiting: it takes what came when it next looks
        inline = self.inline
        if inline is not None:
            try:
                if self._hand_over(inline):
                    return
            except Exception as exc:  # never into the engine's reader: the run's to raise
                self._carry_error = exc
        reader.set_result(None)

    def _hand_over(self, inline: Callable[[list[tuple[int, EngineEvent]]], bool]) -> bool:
        """Give ``inline`` the plain tokens that came; whether the reader may sleep on
        (nothing else came, and ``inline`` took them)."""
        batch: list[tuple[int, EngineEvent]] = []
        self._take(batch, tokens_only=True)  # never raises: an error is not a plain token
        if batch and not inline(batch):
            self._carry.extend(batch)  # no room in the stream: the reader waits for it
            return False
        return not any(stream.has_ready() for stream in self._push)

    def _take(self, batch: list[tuple[int, EngineEvent]], tokens_only: bool = False) -> None:
        """Add to ``batch``, counted, what came from the push sources not finished yet (with
        ``tokens_only``, their plain tokens). A source's error raises after the events
        before it were added."""
        for i, stream in enumerate(self._push):
            if self._sent[i] >= 0:
                for event in stream.take_ready(tokens_only):
                    self._note(i, event)
                    batch.append((i, event))

    def _put(self, item: tuple[int, EngineEvent] | BaseException | None) -> None:
        self._ready.append(item)
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def _direct(self) -> AsyncGenerator[EngineEvent, None]:
        """The one choice's events, read from its engine stream by the reader's task."""
        try:
            for event in self._pending[0]:
                self._note(0, event)
                yield event
            async for event in self._streams[0]:
                self._note(0, event)
                yield event
        except EngineError:
            self._failed = True
            raise

    async def _pump(self, index: int, stream: AsyncIterator[EngineEvent]) -> None:
        try:
            for event in self._pending[index]:
                await self._emit(index, event)
            async for event in stream:
                await self._emit(index, event)
        except EngineError as exc:
            self._failed = True
            self._put(exc)
        except Exception as exc:
            self._put(exc)
        self._put(None)

    async def _emit(self, index: int, event: EngineEvent) -> None:
        if self._room <= 0:  # the reader is behind (the stream store cuts one that stalls)
            self.held = True  # and its timing is the reader's, not the engine's
            while self._room <= 0:
                self._drained.clear()
                await self._drained.wait()
        self._room -= 1
        self._put((index, event))
        self._note(index, event)

    def _note(self, index: int, event: EngineEvent) -> None:
        """Count an event of choice ``index`` as it arrives: the trace, usage, the end."""
        if isinstance(event, TokenEvent):
            self.job.trace.token(index)
            self._sent[index] += 1
            if index == 0:
                self._tokens.append(event.token_id)
                if event.token_id < 0:
                    self._pieces.append(event.text)
        elif isinstance(event, FinishEvent):
            if event.prompt_tokens and not self.prompt_tokens[index]:
                # an engine that learns the prompt's size only at the end (a remote server)
                self.prompt_tokens[index] = event.prompt_tokens
            self.job.trace.choice_finished(index, event)
            self.held = self.held or event.held
            self._finished += 1
            self._sent[index] = -1
            self.usage_tokens += self._prompt_share(index, event.prompt_tokens)
            self.usage_tokens += event.completion_tokens
            if index == 0 and self._on_finished:
                self._on_finished(self, self._tokens)

    @property
    def text(self) -> str:
        """Choice 0's text, as far as its engine gave no token ids (a remote's answer)."""
        return "".join(self._pieces)

    def _prompt_share(self, index: int, prompt_tokens: int) -> int:
        """The n choices of one prompt share it: it counts once, with the first of them."""
        return prompt_tokens if index % self.job.n == 0 else 0

    async def close(self) -> None:
        # no event is handed over after this; and ``inline`` (a closure over the renderer,
        # which holds this run) would keep the request's objects in a cycle, for the
        # collector to find (docs/benchmarks.md, "A request's own cost, with the prompt
        # cache on"), where dropping it frees them as the request ends
        self.inline = None
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            # not tasks.cancel_and_wait: close() runs in the ``finally`` of a reader that is
            # being cancelled (anyio cancels a cancelled scope again at each of its awaits)
            # and must still do the accounting below
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        if not self._closed:
            self._closed = True
            for index, sent in enumerate(self._sent):
                if sent >= 0:  # cut short: its prompt and what it sent were used all the same
                    self.job.trace.choice_cut(index, self.prompt_tokens[index], sent)
                    self.usage_tokens += self._prompt_share(index, self.prompt_tokens[index])
                    self.usage_tokens += sent
            if self._on_done is not None:
                ok = False if self._failed else (self._finished == len(self._streams) or None)
                self._on_done(self, ok)


async def close_all(streams: list[AsyncIterator[EngineEvent]]) -> None:
    """Close engine streams that were opened (each close cancels its generation)."""
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())

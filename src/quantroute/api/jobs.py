"""A request in flight: the :class:`Job` the service prepared (:func:`build_job`), the
:class:`Run` of it on one branch (its choices' events merged as they come), and
:class:`Tick` (idle)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Literal

from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import grammar_of
from quantroute.engines.base import (
    EngineEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from quantroute.engines.chat_template import ChatPrompt
from quantroute.errors import EngineError
from quantroute.observability import NULL_TRACE, RequestTrace
from quantroute.resilience.admission import Ticket
from quantroute.resilience.tenants import OPEN, Tenant
from quantroute.routing.policy import Decision
from quantroute.routing.table import Branch

Kind = Literal["chat", "completion"]
RUN_BUFFER_EVENTS = 64  # a run's events waiting for its reader, per choice


_SEED_MASK = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: Kind
    decision: Decision
    branches: tuple[Branch, ...]  # the decision's branches, in its order
    requests: tuple[GenerationRequest, ...]  # one per choice index
    n: int  # choices per prompt: request i answers prompt i // n
    stream: bool
    include_usage: bool
    logprobs: bool
    deadline: float | None = None  # monotonic seconds; bounds the wait for the first token
    tenant: Tenant = OPEN
    ticket: Ticket | None = None  # its place among the model's running requests
    tools: bool = False  # read tool calls out of the replies (api/tools.py)
    parallel_tool_calls: bool = True
    trace: RequestTrace = NULL_TRACE  # its metrics, spans and log context


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

    :meth:`batches` (a stream's producer in the stream store) reads each choice with a
    pump task into a bounded buffer (``RUN_BUFFER_EVENTS`` per choice), so that what is
    ready together is handed out together: a reader that lags gets one chunk for the
    tokens that piled up. :meth:`events` with one choice and no keep-alives (a whole
    response's collector, which reads as fast as events come) reads it straight from its
    engine stream in the reader's task: no pump, no buffer.
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
        self._streams = streams
        self._pending = pending or [[] for _ in streams]
        self._on_finished = on_finished
        self._on_done = on_done
        self._tokens: list[int] = []  # of choice 0, for the drift monitor
        # Bounded: at most RUN_BUFFER_EVENTS events per choice wait for the reader (``_room``);
        # then the pumps stop, their engine streams fill, and the engine pauses the sequences
        # in the worker (high and low watermarks there). A choice's end or error always fits.
        # A deque and one future, not an asyncio.Queue and a Semaphore: this is per token.
        self._ready: deque[tuple[int, EngineEvent] | BaseException | None] = deque()
        self._reader: asyncio.Future[None] | None = None  # the reader, waiting for an event
        self._room = RUN_BUFFER_EVENTS * max(1, len(streams))
        self._drained = asyncio.Event()  # the reader took events: a full pump may go on
        self._pumps: list[asyncio.Task[None]] = []
        self._finished = 0
        self._sent = [0] * len(streams)  # per choice: tokens it sent; -1 once it finished
        # prompt (once per prompt) and completion tokens; a choice cut short: those it sent
        self.usage_tokens = 0
        self._failed = False
        self._closed = False

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

    async def batches(
        self, keepalive_s: float | None = None
    ) -> AsyncIterator[list[tuple[int, EngineEvent]] | Tick]:
        """Like :meth:`events`, but each time every event that is ready, in order: one
        when the reader keeps up, more when it lags (so it can write them at once)."""
        self._pumps = [
            asyncio.create_task(self._pump(i, s), name=f"pump:{self.job.id}:{i}")
            for i, s in enumerate(self._streams)
        ]
        remaining = len(self._pumps)
        ready = self._ready
        loop = asyncio.get_running_loop()
        try:
            while remaining:
                if not ready:
                    reader = self._reader = loop.create_future()
                    timer = (
                        None
                        if keepalive_s is None
                        else loop.call_later(keepalive_s, _time_out, reader)
                    )
                    try:
                        await reader
                    except TimeoutError:
                        yield Tick()
                        continue
                    finally:
                        self._reader = None
                        if timer is not None:
                            timer.cancel()
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
        elif isinstance(event, FinishEvent):
            self.job.trace.choice_finished(index, event)
            self.held = self.held or event.held
            self._finished += 1
            self._sent[index] = -1
            self.usage_tokens += self._prompt_share(index, event.prompt_tokens)
            self.usage_tokens += event.completion_tokens
            if index == 0 and self._on_finished:
                self._on_finished(self, self._tokens)

    def _prompt_share(self, index: int, prompt_tokens: int) -> int:
        """The n choices of one prompt share it: it counts once, with the first of them."""
        return prompt_tokens if index % self.job.n == 0 else 0

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
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


def request_grammar(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The GBNF a request's output must match (its ``response_format``; a chat request's
    forced tool calls), or ``None``; a 400 for a schema the grammar cannot enforce. Worked
    out before the request is admitted: a request that can never run does not wait in the
    model's queue, nor take a place there."""
    if isinstance(req, ChatCompletionRequest):
        return grammar_of(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    return grammar_of(req.response_format)


def build_job(
    req: ChatCompletionRequest | CompletionRequest,
    decision: Decision,
    branches: tuple[Branch, ...],
    prompt: ChatPrompt | None,
    *,
    max_tokens: int,
    deadline: float | None,
    grammar: str | None,
    tenant: Tenant = OPEN,
    ticket: Ticket | None = None,
    trace: RequestTrace = NULL_TRACE,
) -> Job:
    """The engine requests of a validated request: one per choice (``n`` per prompt),
    with its sampling; ``prompt`` is the rendered chat prompt of a chat request, and
    ``grammar`` the request's :func:`request_grammar`."""
    job_id = uuid.uuid4().hex
    seed = None if req.seed is None else req.seed & _SEED_MASK
    kind: Kind
    # Each kind's own fields first, then one SamplingParams: no copies (this is per request).
    if isinstance(req, ChatCompletionRequest):
        assert prompt is not None
        limit = req.completion_limit
        fit_context, logprobs = limit is None, req.logprobs
        stop, top_logprobs = req.stops + prompt.stops, req.top_logprobs or 0
        prompts = [prompt.text] * req.n
        ids = []
        special = prompt.template == "model"
        kind = "chat"
        chat_tools, parallel_tool_calls = bool(req.active_tools), req.parallel_tool_calls
    else:
        limit = req.max_tokens
        fit_context, logprobs = limit is None, req.logprobs is not None
        stop, top_logprobs = req.stops, req.logprobs or 0
        prompts = [p for p in req.prompts for _ in range(req.n)]
        ids = [tuple(p) for p in req.token_prompts or () for _ in range(req.n)]
        special = False
        kind = "completion"
        chat_tools, parallel_tool_calls = False, True
    sampling = SamplingParams(
        max_tokens=limit or max_tokens,
        fit_context=fit_context,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=req.bias,
        ignore_eos=req.ignore_eos,
        deadline=deadline,
        min_p=req.min_p,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        grammar=grammar,
    )
    requests = tuple(
        GenerationRequest(
            f"{job_id}.{i}",
            text,
            sampling if seed is None else replace(sampling, seed=(seed + i) & _SEED_MASK),
            parse_special=special,
            prompt_ids=ids[i] if ids else None,
        )
        for i, text in enumerate(prompts)
    )
    return Job(
        job_id,
        kind,
        decision,
        branches,
        requests,
        req.n,
        req.stream,
        req.include_usage,
        logprobs,
        deadline,
        tenant,
        ticket,
        tools=chat_tools,
        parallel_tool_calls=parallel_tool_calls,
        trace=trace,
    )

"""A request in flight: the :class:`Job` the service prepared, the :class:`Run` of it on
one branch (its choices' events merged as they come), and :class:`Tick` (idle)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from quantroute.engines.base import EngineEvent, FinishEvent, GenerationRequest, TokenEvent
from quantroute.routing.policy import Decision
from quantroute.routing.table import Branch

Kind = Literal["chat", "completion"]


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


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing happened for a keep-alive interval."""


class Run:
    """A job started on one branch: merged events of its choices."""

    def __init__(
        self,
        job: Job,
        branch: Branch,
        streams: list[AsyncIterator[EngineEvent]],
        prompt_tokens: list[int],
        on_finished: Callable[[Run, list[int]], None] | None = None,
    ):
        self.job = job
        self.branch = branch
        self.prompt_tokens = prompt_tokens
        self._streams = streams
        self._on_finished = on_finished
        self._queue: asyncio.Queue[tuple[int, EngineEvent] | BaseException | None] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []

    async def events(
        self, keepalive_s: float | None = None
    ) -> AsyncIterator[tuple[int, EngineEvent] | Tick]:
        """Every choice's events, interleaved as they come; ``Tick`` when idle."""
        self._pumps = [
            asyncio.create_task(self._pump(i, s), name=f"pump:{self.job.id}:{i}")
            for i, s in enumerate(self._streams)
        ]
        remaining = len(self._pumps)
        try:
            while remaining:
                if not self._queue.empty():
                    item = self._queue.get_nowait()  # the common case: no timer, no task
                else:
                    try:
                        item = await asyncio.wait_for(self._queue.get(), keepalive_s)
                    except TimeoutError:
                        yield Tick()
                        continue
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def _pump(self, index: int, stream: AsyncIterator[EngineEvent]) -> None:
        tokens: list[int] = []  # of choice 0, for the drift monitor
        try:
            async for event in stream:
                self._queue.put_nowait((index, event))
                if index == 0 and isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                elif index == 0 and isinstance(event, FinishEvent) and self._on_finished:
                    self._on_finished(self, tokens)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(None)

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


async def close_all(streams: list[AsyncIterator[EngineEvent]]) -> None:
    """Close engine streams that were opened (each close cancels its generation)."""
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

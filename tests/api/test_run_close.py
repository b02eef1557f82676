"""A run's close() finishes its books when the reader that calls it is being cancelled,
and cancelled again while close() waits: anyio (Starlette's streaming) cancels a
cancelled scope again at each of its awaits, so close() in the reader's ``finally``
must not stop at the first."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from quantroute.api.run import Run
from quantroute.engines.base import EngineEvent, TokenEvent


class _SlowToStop:
    """An engine stream that gives one token, then takes a few turns of the loop to end
    when its reader is cancelled (as a remote's HTTP stream closing does)."""

    def __init__(self) -> None:
        self.sent = False
        self.closed = False

    def __aiter__(self) -> _SlowToStop:
        return self

    async def __anext__(self) -> EngineEvent:
        if not self.sent:
            self.sent = True
            return TokenEvent("a", 1)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


async def test_a_run_closes_its_books_even_when_its_reader_is_cancelled_again() -> None:
    cut: list[tuple[int, int, int]] = []
    done: list[bool | None] = []
    job: Any = SimpleNamespace(
        id="j",
        n=1,
        trace=SimpleNamespace(token=lambda _: None, choice_cut=lambda *a: cut.append(a)),
    )
    stream = _SlowToStop()
    run = Run(job, SimpleNamespace(), [stream], [3], on_done=lambda _, ok: done.append(ok))  # type: ignore[arg-type]

    async def read() -> None:
        async for _ in run.batches():
            pass

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.01)  # the token is read; the pump waits for the next
    reader.cancel()
    await asyncio.sleep(0.01)  # the reader is in close(), waiting for its pump to end
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert done == [None] and stream.closed  # cut short: neither failed nor finished
    assert cut == [(0, 3, 1)] and run.usage_tokens == 4  # its prompt and the token it sent

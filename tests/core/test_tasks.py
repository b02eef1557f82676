"""cancel_and_wait: the task ends, the caller's own cancellation is never swallowed, and a
task's error is logged rather than raised out of whoever stops it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from quantroute.tasks import cancel_and_wait


async def test_a_running_task_is_cancelled_and_waited_for() -> None:
    ended: list[str] = []

    async def loop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # a clean-up that takes turns of the loop
            ended.append("clean")

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and ended == ["clean"]
    await cancel_and_wait(None)  # nothing to stop
    await cancel_and_wait(task)  # already ended


async def test_the_callers_cancellation_is_raised_not_swallowed() -> None:
    """The idiom it replaces, ``suppress(CancelledError): await task``, let a stop()
    that was itself cancelled carry on as if nothing had happened."""
    release = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await release.wait()

    task = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    after: list[str] = []

    async def stop() -> None:
        await cancel_and_wait(task)
        after.append("went on")

    stopper = asyncio.create_task(stop())
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert after == [] and not task.done()  # the task is still ending by itself
    release.set()
    await asyncio.wait({task})
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("the reader broke")

    task = asyncio.create_task(fails(), name="reader")
    await asyncio.wait({task})
    with caplog.at_level(logging.ERROR, logger="quantroute.tasks"):
        await cancel_and_wait(task)
    (record,) = caplog.records
    assert "task reader ended with an error" in record.getMessage()
    assert record.exc_info is not None and "the reader broke" in str(record.exc_info[1])


async def test_an_error_raised_while_cancelling_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def breaks_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise OSError("the socket was already closed") from None

    task = asyncio.create_task(breaks_on_cancel(), name="link")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="quantroute.tasks"):
        await cancel_and_wait(task)
    assert [r.getMessage() for r in caplog.records] == ["task link ended with an error"]

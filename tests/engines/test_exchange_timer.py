"""``ExchangeTimer``: one loop timer per exchange that still bounds every wait."""

from __future__ import annotations

import asyncio
import contextlib

from quantroute.engines.llamacpp.exchange_timer import ExchangeTimer

IDLE = 0.05


async def _consume(timer: ExchangeTimer, queue: asyncio.Queue[int], n: int) -> int:
    """Take ``n`` items the way ``_exchange`` does; how many before the timer ran out."""
    for got in range(n):
        if queue.empty():
            timer.waiting()
            await queue.get()
            timer.got()
        else:
            queue.get_nowait()
        if timer.expired is not None:
            return got
    return n


async def _feed(queue: asyncio.Queue[int], n: int, every_s: float) -> None:
    for i in range(n):
        await asyncio.sleep(every_s)
        queue.put_nowait(i)


async def test_events_more_often_than_the_idle_bound_never_expire() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    timer = ExchangeTimer(asyncio.get_running_loop(), IDLE, None, lambda: queue.put_nowait(-1))
    feeder = asyncio.create_task(_feed(queue, 12, IDLE / 3))  # 4 idle bounds in all
    assert await _consume(timer, queue, 12) == 12 and timer.expired is None
    await feeder
    timer.cancel()


async def test_a_wait_past_the_idle_bound_expires_and_wakes_the_waiter() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    timer = ExchangeTimer(asyncio.get_running_loop(), IDLE, None, lambda: queue.put_nowait(-1))
    queue.put_nowait(0)
    await asyncio.sleep(IDLE * 2)  # the consumer is away, not waiting: that is not idle
    assert timer.expired is None
    started = asyncio.get_running_loop().time()
    assert await _consume(timer, queue, 3) == 1  # the first item, then a wait in vain
    waited = asyncio.get_running_loop().time() - started
    assert timer.expired == IDLE and IDLE <= waited < IDLE * 3


async def test_the_total_bound_expires_while_events_keep_coming() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    timer = ExchangeTimer(asyncio.get_running_loop(), IDLE, 4 * IDLE, lambda: None)
    feeder = asyncio.create_task(_feed(queue, 40, IDLE / 4))
    got = await _consume(timer, queue, 40)
    feeder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await feeder
    assert timer.expired == 4 * IDLE and 1 <= got < 40  # 40 would take 10 idle bounds
    timer.cancel()

"""Admission on plain asyncio: the bounded queue, fast refusals, priority, fairness."""

from __future__ import annotations

import asyncio
import time

import pytest

from quantroute.errors import ServiceUnavailableError
from quantroute.resilience import Admission, Ticket


async def test_a_full_queue_is_a_fast_503() -> None:
    a = Admission(queue_size=2, slots_factor=1.0, retry_after_s=3.0)
    running = await a.enter("m", capacity=1)
    waiting = [asyncio.create_task(a.enter("m", capacity=1)) for _ in range(2)]
    await asyncio.sleep(0)
    assert a.running("m") == 1 and a.waiting("m") == 2
    started = time.perf_counter()
    with pytest.raises(ServiceUnavailableError) as info:
        await a.enter("m", capacity=1)
    assert time.perf_counter() - started < 0.01 and info.value.retry_after_s == 3.0
    running.release()
    second = await waiting[0]
    assert a.running("m") == 1 and a.waiting("m") == 1
    second.release()
    (await waiting[1]).release()
    assert a.running("m") == 0


async def test_an_expected_wait_past_the_deadline_is_refused_at_once() -> None:
    a = Admission(queue_size=8)
    first = await a.enter("m", capacity=1)
    first.release()  # one request of 1 s mean service (the starting estimate)
    holder = await a.enter("m", capacity=1)
    with pytest.raises(ServiceUnavailableError, match="expected wait"):
        await a.enter("m", capacity=1, deadline=time.monotonic() + 0.05)
    holder.release()


async def test_a_waiter_whose_deadline_passes_gets_a_503_and_leaves_the_queue() -> None:
    a = Admission(queue_size=8)
    a._models.setdefault(
        "m",
        a._models.get("m")
        or __import__("quantroute.resilience.admission", fromlist=["_Model"])._Model(
            mean_service_s=0.001
        ),
    )
    holder = await a.enter("m", capacity=1)
    with pytest.raises(ServiceUnavailableError, match="deadline passed"):
        await a.enter("m", capacity=1, deadline=time.monotonic() + 0.05)
    assert a.waiting("m") == 0
    holder.release()
    assert a.running("m") == 0


async def test_higher_priority_goes_first_and_equal_tenants_share() -> None:
    in_flight = {"busy": 5, "idle": 0}
    a = Admission(queue_size=8, in_flight_of=lambda t: in_flight.get(t, 0))
    holder = await a.enter("m", capacity=1)
    order: list[str] = []

    async def wait(name: str, priority: int, tenant: str) -> None:
        ticket: Ticket = await a.enter("m", capacity=1, priority=priority, tenant=tenant)
        order.append(name)
        ticket.release()

    tasks = [
        asyncio.create_task(wait("low", -1, "idle")),
        asyncio.create_task(wait("busy-tenant", 0, "busy")),
        asyncio.create_task(wait("idle-tenant", 0, "idle")),
        asyncio.create_task(wait("high", 5, "busy")),
    ]
    await asyncio.sleep(0)
    holder.release()
    await asyncio.gather(*tasks)
    # priority first; among equals the tenant with fewer requests in flight; low last
    assert order == ["high", "idle-tenant", "busy-tenant", "low"]


async def test_a_client_that_leaves_while_waiting_frees_its_place() -> None:
    a = Admission(queue_size=1)
    holder = await a.enter("m", capacity=1)
    waiter = asyncio.create_task(a.enter("m", capacity=1))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.waiting("m") == 0
    holder.release()
    assert a.running("m") == 0

"""Admission control: a bounded, prioritised queue in front of each model.

At most ``capacity`` requests of a model run at once (the sequences its ready
branches decode together, times ``admission.slots_factor``, so the workers'
own batching stays fed). The rest wait here, in a queue of at most
``admission.queue_size``, and the answer is always fast:

- the queue is full: 503 (the server is saturated), with ``Retry-After``;
- the expected wait (place in the queue x the model's mean service time /
  capacity) is past the request's deadline: 503 at once, not a hang;
- a waiter whose deadline passes while queued: 503 then.

When a slot frees, the waiter with the highest priority (the request's and its
tenant's, added) goes next; among equals, the one whose tenant has the fewest
requests in flight (tenants of one priority share fairly), then the oldest.

>>> import asyncio
>>> async def demo():
...     a = Admission(queue_size=1, slots_factor=1.0)
...     first = await a.enter("m", capacity=1)
...     return a.running("m"), a.waiting("m")
>>> asyncio.run(demo())
(1, 0)
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from quantroute.errors import ServiceUnavailableError

__all__ = ["Admission", "Ticket"]

_EWMA = 0.2  # weight of the newest service time in the model's mean


@dataclass(eq=False, slots=True)
class _Waiter:
    priority: int
    tenant: str
    seq: int
    future: asyncio.Future[None]


@dataclass(slots=True)
class _Model:
    running: int = 0
    waiters: list[_Waiter] = field(default_factory=list)
    mean_service_s: float = 1.0


class Ticket:
    """A place among a model's running requests; ``release`` it exactly once."""

    __slots__ = ("_admission", "_model", "_released", "_started", "waited_s")

    def __init__(self, admission: Admission, model: str, waited_s: float):
        self._admission = admission
        self._model = model
        self._started = time.monotonic()
        self._released = False
        self.waited_s = waited_s

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._leave(self._model, time.monotonic() - self._started)


class Admission:
    def __init__(
        self,
        *,
        queue_size: int = 64,
        slots_factor: float = 2.0,
        retry_after_s: float = 1.0,
        in_flight_of: Callable[[str], int] = lambda tenant: 0,
    ):
        self._queue_size = queue_size
        self._slots_factor = slots_factor
        self._retry_after_s = retry_after_s
        self._in_flight_of = in_flight_of  # a tenant's requests in flight (fairness)
        self._models: dict[str, _Model] = {}
        self._seq = itertools.count()

    def running(self, model: str) -> int:
        return self._models.get(model, _Model()).running

    def waiting(self, model: str) -> int:
        return len(self._models.get(model, _Model()).waiters)

    def capacity(self, slots: int) -> int:
        """Requests of a model that may run at once, given its branches' decode slots."""
        return max(1, round(slots * self._slots_factor))

    async def enter(
        self,
        model: str,
        *,
        capacity: int,
        priority: int = 0,
        tenant: str = "",
        deadline: float | None = None,
    ) -> Ticket:
        """Wait for a place among ``model``'s running requests (see the module docstring)."""
        m = self._models.setdefault(model, _Model())
        now = time.monotonic()
        if m.running < capacity and not m.waiters:
            m.running += 1
            return Ticket(self, model, 0.0)
        if len(m.waiters) >= self._queue_size:
            raise ServiceUnavailableError(
                f"the server is saturated: {len(m.waiters)} requests for {model} already wait",
                retry_after_s=self._retry_after_s,
            )
        ahead = sum(1 for w in m.waiters if w.priority >= priority)
        expected_s = (ahead + 1) * m.mean_service_s / max(capacity, 1)
        if deadline is not None and now + expected_s > deadline:
            raise ServiceUnavailableError(
                f"the expected wait for {model} ({expected_s:.2f} s) is past the deadline",
                retry_after_s=max(self._retry_after_s, expected_s),
            )
        waiter = _Waiter(
            priority, tenant, next(self._seq), asyncio.get_running_loop().create_future()
        )
        m.waiters.append(waiter)
        try:
            timeout = None if deadline is None else max(0.0, deadline - now)
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError as exc:
            if waiter.future.done():  # granted just as time ran out: give the place back
                self._leave(model, None)
            else:
                m.waiters.remove(waiter)
            raise ServiceUnavailableError(
                f"the request's deadline passed while it waited for {model}",
                retry_after_s=self._retry_after_s,
            ) from exc
        except BaseException:  # the client left while waiting
            if waiter.future.done():
                self._leave(model, None)
            else:
                m.waiters.remove(waiter)
                waiter.future.cancel()
            raise
        return Ticket(self, model, time.monotonic() - now)

    def _leave(self, model: str, service_s: float | None) -> None:
        m = self._models[model]
        if service_s is not None:
            m.mean_service_s += _EWMA * (service_s - m.mean_service_s)
        m.running = max(0, m.running - 1)
        while m.waiters:  # hand the place to the next waiter
            best = max(
                m.waiters,
                key=lambda w: (w.priority, -self._in_flight_of(w.tenant), -w.seq),
            )
            m.waiters.remove(best)
            if not best.future.done():
                best.future.set_result(None)
                m.running += 1
                return

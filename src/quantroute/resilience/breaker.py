"""Circuit breakers: one per branch, so a branch that keeps failing stops getting traffic.

States, as in Envoy's outlier detection and the classic pattern::

    closed ──(failures_to_open failures in a row)──▶ open
    open ──(open time passed)──▶ half-open: up to half_open_probes requests let through
    half-open ──(a probe succeeds)──▶ closed        (the open time resets)
    half-open ──(a probe fails)──▶ open again, for twice as long (up to open_max_s)

The breaker counts what its branch did with requests it let through; its own
rejections never count as failures. Time is passed in (``now``), so the
breaker is pure and table-tested; :class:`Breakers` holds one per branch and
reads the monotonic clock.

>>> b = CircuitBreaker(BreakerPolicy(failures_to_open=2, open_base_s=10, half_open_probes=1))
>>> b.record_failure(0.0); b.record_failure(0.0); b.state(1.0)
<BreakerState.OPEN: 'open'>
>>> b.state(10.0), b.acquire(10.0), b.acquire(10.0)
(<BreakerState.HALF_OPEN: 'half_open'>, True, False)
>>> b.record_success(10.5); b.state(10.5)
<BreakerState.CLOSED: 'closed'>
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["BreakerPolicy", "BreakerState", "Breakers", "CircuitBreaker"]


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failures_to_open: int = 5
    open_base_s: float = 30.0  # the first open period; doubles on each reopening
    open_max_s: float = 300.0
    half_open_probes: int = 2  # requests let through at once while half-open


class CircuitBreaker:
    """One branch's breaker; see the module docstring."""

    __slots__ = ("_failures", "_on_open", "_open_until", "_opens", "_policy", "_probes", "_state")

    def __init__(
        self, policy: BreakerPolicy | None = None, on_open: Callable[[], None] | None = None
    ):
        self._policy = policy or BreakerPolicy()
        self._on_open = on_open  # told each time it opens (Breakers' version)
        self._state = BreakerState.CLOSED
        self._failures = 0  # in a row, while closed
        self._opens = 0  # openings since it was last closed by a success
        self._open_until = 0.0
        self._probes = 0  # probes in flight while half-open

    @property
    def opens(self) -> int:
        return self._opens

    @property
    def failures(self) -> int:
        return self._failures

    def open_until(self) -> float:
        return self._open_until

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now >= self._open_until:
            self._state = BreakerState.HALF_OPEN
            self._probes = 0
        return self._state

    def allows(self, now: float) -> bool:
        """Whether a request could go through now (without taking a probe slot)."""
        state = self.state(now)
        if state is BreakerState.OPEN:
            return False
        return state is BreakerState.CLOSED or self._probes < self._policy.half_open_probes

    def acquire(self, now: float) -> bool:
        """Let a request through (``True``), taking a probe slot when half-open."""
        if not self.allows(now):
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probes += 1
        return True

    def record_success(self, now: float) -> None:
        if self.state(now) is BreakerState.HALF_OPEN:
            self._state = BreakerState.CLOSED
            self._opens = 0
        self._failures = 0
        self._probes = max(0, self._probes - 1)

    def record_failure(self, now: float) -> None:
        state = self.state(now)
        if state is BreakerState.HALF_OPEN:
            self._open(now)
        elif state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self._policy.failures_to_open:
                self._open(now)

    def release(self, now: float) -> None:
        """A request it let through ended with neither verdict (the client left, say)."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)

    def _open(self, now: float) -> None:
        p = self._policy
        self._opens += 1
        self._state = BreakerState.OPEN
        self._open_until = now + min(p.open_max_s, p.open_base_s * 2 ** (self._opens - 1))
        self._failures = 0
        self._probes = 0
        if self._on_open is not None:
            self._on_open()


class Breakers:
    """One :class:`CircuitBreaker` per branch id, made on first use.

    ``version`` counts openings: while it holds, a breaker that was closed is still
    closed (only an opening leaves that state), so routing rereads breakers only when
    it moved or while one is not closed (:meth:`closed`)."""

    def __init__(self, policy: BreakerPolicy | None = None):
        self._policy = policy or BreakerPolicy()
        self._breakers: dict[str, CircuitBreaker] = {}
        self.version = 0

    def _opened(self) -> None:
        self.version += 1

    def get(self, branch_id: str) -> CircuitBreaker:
        breaker = self._breakers.get(branch_id)
        if breaker is None:
            breaker = self._breakers[branch_id] = CircuitBreaker(self._policy, self._opened)
        return breaker

    def closed(self, branch_id: str) -> bool:
        """Whether the branch's breaker is closed (none yet counts as closed)."""
        breaker = self._breakers.get(branch_id)
        return breaker is None or breaker.state(time.monotonic()) is BreakerState.CLOSED

    def reset(self, branch_id: str) -> None:
        """A fresh breaker for ``branch_id`` (a reload replaced its file and worker)."""
        self._breakers.pop(branch_id, None)

    def is_open(self, branch_id: str) -> bool:
        """Routing's view: ``True`` while the breaker would turn a request away."""
        breaker = self._breakers.get(branch_id)
        return breaker is not None and not breaker.allows(time.monotonic())

    def acquire(self, branch_id: str) -> bool:
        return self.get(branch_id).acquire(time.monotonic())

    def success(self, branch_id: str) -> None:
        self.get(branch_id).record_success(time.monotonic())

    def failure(self, branch_id: str) -> None:
        self.get(branch_id).record_failure(time.monotonic())

    def release(self, branch_id: str) -> None:
        self.get(branch_id).release(time.monotonic())

    def states(self) -> dict[str, BreakerState]:
        now = time.monotonic()
        return {branch_id: b.state(now) for branch_id, b in self._breakers.items()}

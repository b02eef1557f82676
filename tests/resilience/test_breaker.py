"""The circuit breaker and the retry budget on plain data: a table of events and states."""

from __future__ import annotations

import pytest

from quantroute.resilience import BreakerPolicy, BreakerState, CircuitBreaker, RetryBudget

P = BreakerPolicy(failures_to_open=3, open_base_s=10.0, open_max_s=25.0, half_open_probes=1)
CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def _run(events: list[tuple[float, str]]) -> CircuitBreaker:
    b = CircuitBreaker(P)
    for now, what in events:
        if what == "fail":
            b.record_failure(now)
        elif what == "ok":
            b.record_success(now)
        elif what == "acquire":
            assert b.acquire(now)
    return b


@pytest.mark.parametrize(
    ("events", "at", "state"),
    [
        ([], 0.0, CLOSED),
        ([(0, "fail"), (0, "fail")], 0.0, CLOSED),  # two in a row: not yet
        ([(0, "fail"), (0, "fail"), (0, "ok"), (0, "fail"), (0, "fail")], 0.0, CLOSED),  # reset
        ([(0, "fail")] * 3, 0.0, OPEN),
        ([(0, "fail")] * 3, 9.9, OPEN),
        ([(0, "fail")] * 3, 10.0, HALF),  # open for open_base_s
        ([(0, "fail")] * 3 + [(10, "acquire"), (10, "ok")], 10.0, CLOSED),
        ([(0, "fail")] * 3 + [(10, "acquire"), (10, "fail")], 29.9, OPEN),  # twice as long
        ([(0, "fail")] * 3 + [(10, "acquire"), (10, "fail")], 30.0, HALF),
        # doubling stops at open_max_s: 10, 20, then 25 (not 40)
        (
            [(0, "fail")] * 3 + [(10, "acquire"), (10, "fail"), (30, "acquire"), (30, "fail")],
            54.9,
            OPEN,
        ),
        (
            [(0, "fail")] * 3 + [(10, "acquire"), (10, "fail"), (30, "acquire"), (30, "fail")],
            55.0,
            HALF,
        ),
    ],
)
def test_breaker_states(events: list[tuple[float, str]], at: float, state: BreakerState) -> None:
    assert _run(events).state(at) is state


def test_half_open_lets_only_its_probes_through() -> None:
    b = _run([(0, "fail")] * 3)
    assert not b.allows(5.0) and not b.acquire(5.0)  # open: turned away
    assert b.acquire(10.0)  # the one probe
    assert not b.acquire(10.0)  # no second one while it is out
    b.release(10.5)  # the probe ended without a verdict (client left)
    assert b.acquire(11.0)


def test_its_own_rejections_never_count() -> None:
    b = _run([(0, "fail")] * 3)
    for t in range(9):
        assert not b.acquire(float(t))  # rejected while open: no failures recorded
    assert b.opens == 1 and b.state(10.0) is HALF


def test_a_success_after_reopening_resets_the_open_time() -> None:
    b = _run([(0, "fail")] * 3 + [(10, "acquire"), (10, "fail"), (30, "acquire"), (30, "ok")])
    assert b.state(30.0) is CLOSED and b.opens == 0
    for _ in range(3):
        b.record_failure(31.0)
    assert b.state(40.9) is OPEN and b.state(41.0) is HALF  # back to 10 s


@pytest.mark.parametrize(
    ("active", "ratio", "minimum", "allowed"),
    [(0, 0.2, 3, 3), (10, 0.2, 3, 3), (50, 0.2, 3, 10), (100, 0.5, 0, 50), (4, 0.2, 0, 0)],
)
def test_retry_budget(active: int, ratio: float, minimum: int, allowed: int) -> None:
    budget = RetryBudget(ratio=ratio, min_retries=minimum)
    for _ in range(active):
        budget.start()
    granted = sum(budget.try_retry() for _ in range(active + 10))
    assert granted == allowed and budget.refused == active + 10 - allowed
    budget.finish(retries=granted)
    assert budget.retrying == 0 and budget.active == max(0, active - 1)

"""Health factors: exponential decay with a half-life, XID/ECC increases as failures."""

from __future__ import annotations

import math

import pytest

from quantroute.telemetry import DeviceKind, DeviceStats, HealthTracker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gpu(
    device_id: str = "cuda:0", *, xid: int | None = 0, ecc: int | None = 0, healthy: bool = True
) -> DeviceStats:
    return DeviceStats(
        device_id,
        DeviceKind.CUDA,
        "gpu",
        100,
        0,
        100,
        xid_errors=xid,
        ecc_errors=ecc,
        healthy=healthy,
    )


@pytest.mark.parametrize(
    ("failures_at", "now", "lam", "expected_recent"),
    [
        ([], 0.0, 0.5, 0.0),
        ([0.0], 0.0, 0.5, 1.0),
        ([0.0], 60.0, 0.5, 0.5),  # one half-life later
        ([0.0], 120.0, 0.5, 0.25),
        ([0.0, 60.0], 60.0, 0.5, 1.5),
        ([0.0, 0.0, 0.0], 0.0, 1.0, 3.0),
    ],
)
def test_decay_and_factor(
    failures_at: list[float], now: float, lam: float, expected_recent: float
) -> None:
    clock = Clock()
    tracker = HealthTracker(lam=lam, half_life_s=60.0, clock=clock)
    for t in failures_at:
        clock.now = t
        tracker.record_failure("cuda:0", "engine_crash")
    clock.now = now
    assert tracker.recent_failures("cuda:0") == pytest.approx(expected_recent)
    assert tracker.factor("cuda:0") == pytest.approx(math.exp(-lam * expected_recent))
    assert tracker.factor("cuda:1") == 1.0


def test_health_recovers_over_time() -> None:
    clock = Clock()
    tracker = HealthTracker(lam=0.5, half_life_s=10.0, clock=clock)
    for _ in range(4):
        tracker.record_failure("cuda:0", "oom")
    low = tracker.factor("cuda:0")
    clock.now = 100.0
    assert low < 0.2 and tracker.factor("cuda:0") > 0.99
    assert tracker.factors(["cuda:0", "cpu"]) == {"cuda:0": tracker.factor("cuda:0"), "cpu": 1.0}
    assert tracker.last_failure_kind("cuda:0") == "oom"


def test_counter_increases_between_readings_are_failures() -> None:
    clock = Clock()
    tracker = HealthTracker(lam=1.0, half_life_s=60.0, clock=clock)
    tracker.observe([gpu(xid=5, ecc=2)])  # baseline: counts since driver load
    assert tracker.recent_failures("cuda:0") == 0.0
    tracker.observe([gpu(xid=5, ecc=2)])
    assert tracker.recent_failures("cuda:0") == 0.0
    tracker.observe([gpu(xid=7, ecc=3)])
    assert tracker.recent_failures("cuda:0") == pytest.approx(3.0)
    tracker.observe([gpu(xid=None, ecc=None)])  # counters become unreadable: no failure
    tracker.observe([gpu(xid=9, ecc=3)])  # nothing to compare with
    assert tracker.recent_failures("cuda:0") == pytest.approx(3.0)


def test_unhealthy_reading_counts_as_a_failure() -> None:
    tracker = HealthTracker(lam=1.0, half_life_s=60.0, clock=Clock())
    tracker.observe([gpu(healthy=False)])
    assert tracker.recent_failures("cuda:0") == 1.0
    assert tracker.last_failure_kind("cuda:0") == "unhealthy"


@pytest.mark.parametrize(("lam", "half_life"), [(-0.1, 60.0), (0.5, 0.0)])
def test_bad_parameters(lam: float, half_life: float) -> None:
    with pytest.raises(ValueError):
        HealthTracker(lam=lam, half_life_s=half_life)

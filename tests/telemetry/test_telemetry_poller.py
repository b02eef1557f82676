"""The poller: publishing, staleness, backoff with jitter, start/stop, lock-free reads."""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest

from quantroute.telemetry import (
    DeviceError,
    DevicePoller,
    DeviceSnapshot,
    HealthTracker,
    SimDeviceProvider,
    backoff_delay,
)

GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Sleeps:
    """Records requested delays; advances the fake clock and yields to the loop instead."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.delays: list[float] = []
        self.event = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.clock.now += delay
        self.event.set()
        await asyncio.sleep(0)


@pytest.mark.parametrize("interval", [0.0, 0.1, 0.499])
def test_interval_below_half_a_second_is_rejected(interval: float) -> None:
    with pytest.raises(ValueError, match="below the minimum"):
        DevicePoller(SimDeviceProvider.from_spec("sim:1x1GiB"), interval_s=interval)


@pytest.mark.parametrize(
    ("failures", "jitter", "expected"),
    [
        (1, 0.0, 1.0),  # 2 s ceiling, halved by jitter, floored at the interval
        (1, 0.999, 1.999),
        (3, 0.0, 4.0),
        (3, 0.5, 6.0),
        (10, 0.999, 29.985),  # capped at max_s
    ],
)
def test_backoff_delay(failures: int, jitter: float, expected: float) -> None:
    assert backoff_delay(failures, 1.0, max_s=30.0, rng=lambda: jitter) == pytest.approx(expected)


def test_backoff_jitter_spreads_retries() -> None:
    import random

    rng = random.Random(7)
    delays = {backoff_delay(4, 1.0, rng=rng.random) for _ in range(50)}
    assert len(delays) > 40 and all(8.0 <= d < 16.0 for d in delays)


async def test_poll_once_publishes_an_immutable_snapshot() -> None:
    clock = Clock()
    sim = SimDeviceProvider.from_spec("sim:2x8GiB;nvlink=0-1")
    poller = DevicePoller(sim, interval_s=1.0, stale_after_intervals=3, clock=clock)
    empty = poller.snapshot
    assert empty.taken_at is None and math.isinf(empty.age_s()) and empty.is_stale()

    sim.attach("sim:1", "b", 2 * GiB)
    snap = await poller.poll_once()
    assert poller.snapshot is snap and snap.taken_at == 1000.0
    assert snap.device("sim:1") is not None and snap.device("sim:1").used_bytes == 2 * GiB
    assert snap.topology.nvlinks("sim:0", "sim:1") == 1
    assert snap.provider == "sim"

    sim.attach("sim:0", "a", 1 * GiB)
    await poller.poll_once()
    assert snap.device("sim:0").used_bytes == 0  # the old snapshot is untouched
    assert poller.snapshot.device("sim:0").used_bytes == 1 * GiB


async def test_staleness_after_n_intervals_and_errors_keep_last_devices() -> None:
    clock = Clock()
    sim = SimDeviceProvider.from_spec("sim:1x8GiB")
    poller = DevicePoller(sim, interval_s=0.5, stale_after_intervals=4, clock=clock)
    snap = await poller.poll_once()
    assert snap.age_s(1001.5) == 1.5 and not snap.is_stale(1001.5)
    assert snap.is_stale(1002.01)

    sim.fail_reads(1)
    with pytest.raises(DeviceError):
        await poller.poll_once()
    failed = poller.snapshot
    assert failed.devices == snap.devices and failed.taken_at == snap.taken_at
    assert failed.consecutive_failures == 1
    assert failed.last_error is not None and "simulated read failure" in failed.last_error
    ok = await poller.poll_once()
    assert ok.last_error is None and ok.consecutive_failures == 0


async def test_loop_polls_every_interval_and_backs_off_on_errors() -> None:
    clock = Clock()
    sleeps = Sleeps(clock)
    sim = SimDeviceProvider.from_spec("sim:1x8GiB")
    poller = DevicePoller(
        sim, interval_s=1.0, backoff_max_s=8.0, clock=clock, sleep=sleeps, rng=lambda: 0.999
    )
    sim.fail_reads(4)
    poller.start()
    with pytest.raises(RuntimeError, match="already started"):
        poller.start()
    while len(sleeps.delays) < 6:
        sleeps.event.clear()
        await sleeps.event.wait()
    await poller.stop()
    assert not poller.running
    # four failures back off 2, 4, 8, 8 s (jitter ~1.0), then the interval again
    assert sleeps.delays[:4] == pytest.approx([1.999, 3.998, 7.996, 7.996])
    assert sleeps.delays[4:6] == [1.0, 1.0]
    assert poller.snapshot.last_error is None and len(poller.snapshot.devices) == 1


async def test_stop_without_start_and_real_sleep_loop() -> None:
    poller = DevicePoller(SimDeviceProvider.from_spec("sim:1x1GiB"), interval_s=0.5)
    await poller.stop()
    poller.start()
    for _ in range(200):
        if poller.snapshot.taken_at is not None:
            break
        await asyncio.sleep(0.01)
    await poller.stop()
    assert poller.snapshot.taken_at is not None and not poller.snapshot.stale


async def test_health_observes_xid_increases_between_polls() -> None:
    clock = Clock()
    sim = SimDeviceProvider.from_spec("sim:2x1GiB")
    health = HealthTracker(lam=1.0, half_life_s=60.0, clock=clock)
    poller = DevicePoller(sim, interval_s=1.0, health=health, clock=clock)
    await poller.poll_once()
    sim.inject_xid("sim:1", 2)
    await poller.poll_once()
    assert health.factor("sim:0") == 1.0
    assert health.factor("sim:1") == pytest.approx(math.exp(-2.0))
    assert health.last_failure_kind("sim:1") == "xid"


async def test_taking_the_snapshot_costs_under_5_microseconds() -> None:
    poller = DevicePoller(SimDeviceProvider.from_spec("sim:8x80GiB"), interval_s=1.0)
    await poller.poll_once()
    samples = []
    perf = time.perf_counter_ns
    for _ in range(10_000):
        start = perf()
        snap: DeviceSnapshot = poller.snapshot
        snap.age_s(time.monotonic())
        samples.append(perf() - start)
    median_us = statistics.median(samples) / 1000
    assert median_us < 5.0, f"median {median_us:.2f} µs"

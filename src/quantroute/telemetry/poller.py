"""The telemetry side loop: read the provider every interval, publish a snapshot.

Reading blocks (NVML, a subprocess, files), so it runs in a thread via
``asyncio.to_thread``. The result is a new immutable :class:`DeviceSnapshot`
whose reference replaces the old one; readers take ``poller.snapshot`` with
no lock (one attribute read). On errors the poller backs off exponentially
with jitter and keeps the last good devices, which age into staleness.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from quantroute.tasks import cancel_and_wait
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.protocol import DeviceProvider
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.topology import Topology

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5


def backoff_delay(
    failures: int,
    interval_s: float,
    *,
    max_s: float = 30.0,
    rng: Callable[[], float] = random.random,
) -> float:
    """Delay before the next try after ``failures`` consecutive failures (≥ 1).

    ``min(max_s, interval · 2**failures)`` scaled by a jitter factor in
    [0.5, 1.0) ("equal jitter"), never below the interval.

    >>> backoff_delay(1, 1.0, rng=lambda: 0.0), backoff_delay(10, 1.0, rng=lambda: 0.999)
    (1.0, 29.985)
    """
    ceiling = min(max_s, interval_s * 2.0**failures)
    return round(max(interval_s, ceiling * (0.5 + 0.5 * rng())), 6)


class DevicePoller:
    """Owns nothing but its task: whoever creates it calls :meth:`start` and :meth:`stop`
    (and closes the provider afterwards).

    ``sleep``, ``clock`` and ``rng`` are injectable so tests drive the loop
    without waiting.
    """

    def __init__(
        self,
        provider: DeviceProvider,
        *,
        interval_s: float = 1.0,
        stale_after_intervals: int = 3,
        backoff_max_s: float = 30.0,
        health: HealthTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if interval_s < MIN_INTERVAL_S:
            raise ValueError(
                f"poll interval {interval_s} s is below the minimum {MIN_INTERVAL_S} s"
            )
        if stale_after_intervals < 1:
            raise ValueError(f"stale_after_intervals must be ≥ 1, got {stale_after_intervals}")
        self._provider = provider
        self._interval_s = interval_s
        self._backoff_max_s = max(backoff_max_s, interval_s)
        self._health = health
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._stale_after_s = interval_s * stale_after_intervals
        self._topology: Topology | None = None
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self.snapshot: DeviceSnapshot = DeviceSnapshot(
            taken_at=None, stale_after_s=self._stale_after_s, provider=provider.name
        )
        """The latest snapshot. Read it freely: it is replaced, never mutated."""
        self.listeners: list[Callable[[DeviceSnapshot], None]] = []
        """Called with each new snapshot, in the loop, before :meth:`poll_once` returns."""

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def poll_once(self) -> DeviceSnapshot:
        """Read the provider now and publish the result; on failure, publish the old devices
        with the error and re-raise. Used by the loop and by one-shot callers
        (``quantroute devices``)."""
        try:
            devices = await asyncio.to_thread(self._provider.read)
            ids = tuple(d.id for d in devices)
            if self._topology is None or ids != self.snapshot.device_ids:
                self._topology = await asyncio.to_thread(self._provider.topology)
        except Exception as exc:  # any provider failure: keep serving the last good picture
            self._failures += 1
            self.snapshot = replace(
                self.snapshot,
                last_error=f"{type(exc).__name__}: {exc}",
                consecutive_failures=self._failures,
            )
            raise
        self._failures = 0
        snapshot = DeviceSnapshot(
            taken_at=self._clock(),
            devices=tuple(devices),
            topology=self._topology,
            stale_after_s=self._stale_after_s,
            provider=self._provider.name,
        )
        self.snapshot = snapshot
        if self._health is not None:
            self._health.observe(snapshot.devices)
        for listener in self.listeners:
            listener(snapshot)
        return snapshot

    async def _run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.poll_once()
                delay = max(0.0, self._interval_s - (self._clock() - started))
            except Exception as exc:  # logged and retried with backoff
                delay = backoff_delay(
                    self._failures, self._interval_s, max_s=self._backoff_max_s, rng=self._rng
                )
                logger.warning(
                    "device poll failed (%d in a row), retrying in %.1f s: %s",
                    self._failures,
                    delay,
                    exc,
                )
            await self._sleep(delay)

    def start(self) -> None:
        """Start polling in the running event loop. Starting twice is an error."""
        if self.running:
            raise RuntimeError("poller already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="device-poller")

    async def stop(self) -> None:
        """Cancel the loop and wait for it; a read in flight finishes in its thread."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

"""``quantroute_event_loop_lag_seconds``: how late the gateway's event loop runs what is due.

Every stream, every accept and every timer of the gateway runs on one event loop, so
anything that holds it (a slow parse, a compile, a collection, a blocking call that
should have been in a thread) delays all of them at once. As SGLang's gateway does, a
timer is set ``interval_s`` ahead, again and again; how late each one fires is the lag
the loop imposed on whatever was due then. Idle or busy, a healthy loop is late by well
under a millisecond; a stall of 200 ms shows as one sample in the 0.25 s bucket.

It is a timer callback, not a task: nothing to await at stop, and a sample costs a few
microseconds (100 a second at the default 10 ms). No lock: it counts on the loop's own
thread, and the scrape that reads it runs there too.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["LAG_BUCKETS_S", "LoopLag"]

LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag(Collector):
    """Samples the running loop's lag every ``interval_s`` while :meth:`start` ed: a
    histogram of every sample, and the longest since the previous scrape (a gauge, so a
    stall between two scrapes is seen whole, whatever the buckets)."""

    name = "quantroute_event_loop_lag_seconds"
    max_name = "quantroute_event_loop_lag_max_seconds"

    def __init__(self, interval_s: float = 0.01, bounds: tuple[float, ...] = LAG_BUCKETS_S):
        self.interval_s = interval_s
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, the last for +Inf
        self._total = 0.0
        self._longest = 0.0  # since the last scrape
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Sample the running loop from now on (once: a second call changes nothing)."""
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self.record(max(0.0, self._loop.time() - self._due))  # never early by more than 1 ns
        self._arm()

    def record(self, lag_s: float) -> None:
        """One sample: the loop ran a callback ``lag_s`` after it was due."""
        self._counts[bisect.bisect_left(self.bounds, lag_s)] += 1
        self._total += lag_s
        self._longest = max(self._longest, lag_s)

    def collect(self) -> Iterator[Metric]:
        running = list(itertools.accumulate(self._counts))
        buckets = [(repr(b), n) for b, n in zip(self.bounds, running, strict=False)]
        family = HistogramMetricFamily(
            self.name,
            "How late the gateway's event loop ran a timer (sampled every "
            "observability.loop_lag_interval_s); each late one delayed every stream.",
        )
        family.add_metric([], [*buckets, ("+Inf", running[-1])], self._total)
        yield family
        longest, self._longest = self._longest, 0.0
        yield GaugeMetricFamily(
            self.max_name,
            "The event loop's longest lag since the previous scrape of /metrics.",
            value=longest,
        )

"""``quantroute_event_loop_lag_seconds``: how late the gateway's event loop runs a timer
set every ``observability.loop_lag_interval_s``, from the gateway's start to its stop
(issue #32: any stall left on the loop shows). A deliberate 200 ms blocking call on the
loop of the real app shows in ``/metrics``."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.observability.loop_lag import LoopLag

NAME = "quantroute_event_loop_lag_seconds"
MAX_NAME = "quantroute_event_loop_lag_max_seconds"


def _read(text: str) -> tuple[dict[str, float], float]:
    """The histogram's ``count``, ``sum`` and ``le=`` buckets, and the max gauge."""
    series: dict[str, float] = {}
    longest = -1.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == MAX_NAME:
                longest = s.value
            elif s.name.startswith(NAME):
                key = s.name.removeprefix(NAME + "_")
                series[key if key != "bucket" else "le=" + s.labels["le"]] = s.value
    return series, longest


async def test_a_200_ms_block_on_the_loop_shows_in_the_metric() -> None:
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"}, observability={"loop_lag_interval_s": 0.005}
    )
    app = create_app(settings, fake_table())
    async with serving(app) as (client, gateway):
        lag = gateway.observer.instruments.loop_lag
        assert lag.interval_s == 0.005
        await asyncio.sleep(0.2)  # samples of an idle loop
        before, _ = _read((await client.get("/metrics")).text)
        assert before["count"] >= 10  # ~40 at 5 ms; a loaded machine fires fewer
        time.sleep(0.2)  # noqa: ASYNC251 (the point: a blocking call on the loop)
        await asyncio.sleep(0.05)
        after, longest = _read((await client.get("/metrics")).text)
        _, next_longest = _read((await client.get("/metrics")).text)
    assert after["count"] > before["count"]
    assert after["sum"] - before["sum"] >= 0.19
    late = after["count"] - after["le=0.1"]  # samples later than 100 ms
    assert late - (before["count"] - before["le=0.1"]) >= 1
    assert after["le=+Inf"] == after["count"]
    assert 0.19 <= longest < 5.0  # the longest since the previous scrape
    assert next_longest < 0.19  # and the gauge starts again at each scrape
    assert lag._handle is None  # stopped with the gateway


async def test_samples_land_in_their_buckets_and_start_is_once() -> None:
    lag = LoopLag(interval_s=0.001, bounds=(0.01, 0.1))
    lag.start()
    first = lag._handle
    lag.start()
    assert lag._handle is first
    await asyncio.sleep(0.05)
    lag.stop()
    lag.stop()
    idle = sum(lag._counts)
    assert idle >= 5 and lag._counts[0] >= idle - 2  # an idle loop is late by under 10 ms
    lag.record(0.05)
    lag.record(0.5)
    histogram, gauge = lag.collect()
    buckets = {s.labels["le"]: s.value for s in histogram.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"] == idle + 2
    assert buckets["0.1"] == buckets["0.01"] + 1 + (idle - lag._counts[0])
    assert gauge.samples[0].value >= 0.5
    (_, again) = lag.collect()
    assert again.samples[0].value == 0.0
    await asyncio.sleep(0.01)
    assert sum(lag._counts) == idle + 2  # stopped: no more samples

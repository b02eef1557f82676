"""``quantroute_gc_pause_seconds``: the garbage collector's pauses in the gateway's process,
timed from the moment the gateway has started until it stops; the real app's ``/metrics``."""

from __future__ import annotations

import gc

from prometheus_client.parser import text_string_to_metric_families

from qrtest import fake_app, serving
from quantroute.observability.instruments import GcPauses

NAME = "quantroute_gc_pause_seconds"


def _histogram(text: str) -> dict[str, dict[str, float]]:
    """Per generation: its ``count``, ``sum`` and cumulative ``le`` buckets."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != NAME:
            continue
        for s in family.samples:
            series = out.setdefault(s.labels["generation"], {})
            key = s.name.removeprefix(NAME + "_")
            series[key if key != "bucket" else "le=" + s.labels["le"]] = s.value
    return out


async def test_each_collection_of_the_running_gateway_is_timed_by_generation() -> None:
    app = fake_app()
    async with serving(app) as (client, gateway):
        hook = gateway.observer.instruments.gc_pauses._hook
        assert gc.callbacks.count(hook) == 1
        before = _histogram((await client.get("/metrics")).text)
        gc.collect()  # one full collection of...
        ballast = [[i] for i in range(300_000)]  # ...then one that walks these
        gc.collect()
        after = _histogram((await client.get("/metrics")).text)
        del ballast
    assert set(after) == {"0", "1", "2"}
    full = after["2"]
    assert full["count"] - before["2"]["count"] >= 2  # scrapes may collect too, never fewer
    assert full["sum"] > before["2"]["sum"]
    assert full["le=+Inf"] == full["count"]
    buckets = [v for k, v in full.items() if k.startswith("le=")]
    assert buckets == sorted(buckets)  # cumulative
    # walking 300,000 lists takes more than 0.5 ms on any machine: not all in the first bucket
    assert full["le=0.0005"] < full["count"]
    assert hook not in gc.callbacks  # stopped with the gateway


def test_a_pause_lands_in_its_bucket_and_install_is_once() -> None:
    pauses = GcPauses(bounds=(0.001, 0.01))
    pauses.install()
    pauses.install()
    try:
        assert gc.callbacks.count(pauses._hook) == 1
        pauses._hook("start", {"generation": 1})
        pauses._hook("stop", {"generation": 1})  # well under a millisecond
    finally:
        pauses.uninstall()
    assert pauses._hook not in gc.callbacks
    (family,) = pauses.collect()
    samples = [s for s in family.samples if s.labels["generation"] == "1"]
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets == {"0.001": 1, "0.01": 1, "+Inf": 1}
    assert [s.value for s in samples if s.name.endswith("_count")] == [1]
    others = [s for s in family.samples if s.labels["generation"] != "1"]
    assert all(s.value == 0 for s in others)

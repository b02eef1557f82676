"""A request that fails on a worker a reload has replaced does not count against the
breaker of the branch's new worker (which starts fresh)."""

from __future__ import annotations

import asyncio

import pytest

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine, FakeFaults

BODY = {"model": "tiny-llama:f16", "prompt": "x", "max_tokens": 50}


@pytest.mark.parametrize("replaced", [False, True])
async def test_a_replaced_workers_failure_stays_its_own(replaced: bool) -> None:
    old = FakeEngine(token_delay_s=0.01, faults=FakeFaults(crash_after=20))
    settings = load_settings(telemetry={"devices": "sim:1x8GiB"})
    async with serving(create_app(settings, table=fake_table({"f16": old}))) as (http, gateway):
        request = asyncio.create_task(http.post("/v1/completions", json=BODY))
        while old.in_flight == 0:  # noqa: ASYNC110 (the fake engine has no event for it)
            await asyncio.sleep(0.005)
        if replaced:  # as a reload's swap does: a new worker serves the id from now on
            fresh = FakeEngine()
            await fresh.start()
            gateway.routes.current = fake_table({"f16": fresh})
        r = await request
        assert r.status_code >= 500  # the old worker crashed mid-request
        failures = gateway.breakers.get("tiny-llama:f16").failures
        assert failures == (0 if replaced else 1)

"""Breakers, the retry budget and the first-token commit point, through the real app
(fake engines: the faults are injected, everything around them is real)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from qrtest import ADMIN, ADMIN_KEY, fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.base import Engine, EngineEvent, GenerationRequest
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.errors import DeviceOutOfMemoryError

FAST = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "fast"}


@asynccontextmanager
async def _client(
    engines: dict[str, Engine], **resilience: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        telemetry={"devices": "sim:1x24GiB"},
        resilience={"breaker_failures": 3, "breaker_open_s": 0.3, **resilience},
    )
    async with serving(create_app(settings, table=fake_table(engines))) as (client, _):
        yield client


async def test_a_failing_branch_opens_its_breaker_then_is_probed_and_closes() -> None:
    refusing = FakeEngine(faults=FakeFaults(refuse=True))
    async with _client({"f16": refusing, "q8_0": FakeEngine(), "q4_k_m": FakeEngine()}) as c:
        # memory is ample: the reference (f16) fits best; it fails before its first token
        for _ in range(3):
            r = await c.post("/v1/completions", json=FAST)
            assert r.status_code == 200 and r.headers["x-quantroute-branch"] != "tiny-llama:f16"
        status = (await c.get("/admin/status", headers=ADMIN)).json()
        breaker = status["branches"]["tiny-llama:f16"]["breaker"]
        assert breaker["state"] == "open" and breaker["opens"] == 1
        assert 0 < breaker["open_for_s"] <= 0.3
        metrics = (await c.get("/metrics")).text
        assert 'quantroute_branch_breaker_open{branch="f16",model="tiny-llama"} 1.0' in metrics
        explain = (await c.post("/v1/route/explain", json=FAST)).json()
        f16 = next(b for b in explain["branches"] if b["branch"] == "tiny-llama:f16")
        assert {"name": "breaker", "passed": False, "reason": "open"} in f16["filters"]
        # while open, routing passes it over: its rejections are not failures
        for _ in range(5):
            assert (await c.post("/v1/completions", json=FAST)).status_code == 200
        assert (await c.get("/admin/status", headers=ADMIN)).json()["branches"]["tiny-llama:f16"][
            "breaker"
        ]["opens"] == 1

        refusing.faults.refuse = False  # it recovers
        await asyncio.sleep(0.35)  # half-open: the next request is a probe
        r = await c.post("/v1/completions", json=FAST)
        assert r.headers["x-quantroute-branch"] == "tiny-llama:f16"
        state = (await c.get("/admin/status", headers=ADMIN)).json()
        assert state["branches"]["tiny-llama:f16"]["breaker"]["state"] == "closed"


async def test_a_failed_probe_reopens_for_longer() -> None:
    refusing = FakeEngine(faults=FakeFaults(refuse=True))
    async with _client({"f16": refusing, "q4_k_m": FakeEngine()}) as c:
        for _ in range(3):
            await c.post("/v1/completions", json=FAST)
        await asyncio.sleep(0.35)
        await c.post("/v1/completions", json=FAST)  # the probe fails
        breaker = (await c.get("/admin/status", headers=ADMIN)).json()["branches"][
            "tiny-llama:f16"
        ]["breaker"]
        assert breaker["state"] == "open" and breaker["opens"] == 2
        assert 0.3 < breaker["open_for_s"] <= 0.6  # twice the base


async def test_no_first_token_in_time_moves_the_request_to_the_next_branch() -> None:
    stalled = FakeEngine(token_delay_s=5.0)  # accepts, then sends nothing for 5 s
    async with _client({"f16": stalled, "q4_k_m": FakeEngine()}, first_token_timeout_s=0.2) as c:
        started = asyncio.get_running_loop().time()
        r = await c.post("/v1/completions", json=FAST)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:q4_k_m"
        assert asyncio.get_running_loop().time() - started < 2.0
        # the deadline cuts the wait shorter than the setting
        r = await c.post(
            "/v1/completions",
            json=FAST | {"model": "tiny-llama:f16"},
            headers={"x-quantroute-deadline-ms": "100"},
        )
        # the client's own deadline: a 503 to retry, not the branch's failure
        assert r.status_code == 503 and "first token" in r.json()["error"]["message"]
        assert "retry-after" in r.headers


async def test_the_retry_budget_caps_retries() -> None:
    # every branch but the last refuses: each request needs retries; min 0, ratio 0
    engines: dict[str, Engine] = {
        "f16": FakeEngine(faults=FakeFaults(refuse=True)),
        "q8_0": FakeEngine(faults=FakeFaults(refuse=True)),
        "q4_k_m": FakeEngine(),
    }
    async with _client(engines, retry_ratio=0.0, retry_min=0, breaker_failures=100) as c:
        r = await c.post("/v1/completions", json=FAST)
        assert r.status_code == 503 and "retry-after" in r.headers
        status = (await c.get("/admin/status", headers=ADMIN)).json()
        assert status["retry_budget"]["refused"] >= 1
        assert status["retry_budget"]["retries_in_flight"] == 0
    async with _client(engines, retry_ratio=0.0, retry_min=2, breaker_failures=100) as c:
        r = await c.post("/v1/completions", json=FAST)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:q4_k_m"


class _OutOfMemory(FakeEngine):
    """Fails every new sequence's KV allocation while ``out`` is set, as a worker on a device
    over its budget does."""

    out = True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        if self.out:
            raise DeviceOutOfMemoryError("fake: no room for the KV cache")
        async for event in super().generate(request):
            yield event


async def test_out_of_memory_falls_back_without_opening_the_breaker() -> None:
    # the device's memory, not the branch's fault: once memory is back the branch serves at
    # once, where an open breaker would keep it shut for its open time
    oom = _OutOfMemory()
    async with _client({"f16": oom, "q8_0": FakeEngine()}, breaker_open_s=30.0) as c:
        for _ in range(5):  # more than breaker_failures (3) in a row
            r = await c.post("/v1/completions", json=FAST | {"model": "tiny-llama:f16"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "device_out_of_memory"
            r = await c.post("/v1/completions", json=FAST)  # f16 first, as ample memory says
            assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
        status = (await c.get("/admin/status", headers=ADMIN)).json()
        assert status["branches"]["tiny-llama:f16"]["breaker"]["state"] == "closed"
        oom.out = False
        r = await c.post("/v1/completions", json=FAST | {"model": "tiny-llama:f16"})
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:f16"

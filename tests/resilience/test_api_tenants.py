"""Tenants and admission through the real app (fake engines; real HTTP handling)."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import pytest

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

TENANTS = """
tenants:
  limited:
    keys: ["sk-limited"]
    requests_per_minute: 3
  single:
    keys: ["sk-single"]
    max_concurrency: 1
  other-model-only:
    keys: ["sk-other"]
    models: ["other-model"]
  big:
    keys: ["sk-big"]
    priority: 5
"""
ASK = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "fast"}


def _key(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return path


async def test_keys_tenants_and_their_limits(
    tenants_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(
        auth={"tenants_file": str(tenants_file)}, telemetry={"devices": "sim:1x8GiB"}
    )
    async with serving(create_app(settings, table=fake_table())) as (c, _):
        assert not any("open to anyone" in r.getMessage() for r in caplog.records)
        for headers in ({}, _key("sk-nope"), {"authorization": "Basic c2stYmln"}):
            r = await c.post("/v1/completions", json=ASK, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert "sk-nope" not in r.text
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/v1/route/explain", json=ASK)).status_code == 401  # protected
        assert (await c.get("/metrics")).status_code == 200  # open by default
        assert (await c.get("/healthz")).status_code == 200

        # a tenant sees and uses only its models
        assert (await c.get("/v1/models", headers=_key("sk-other"))).json()["data"] == []
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-other"))
        assert r.status_code == 404
        ids = [m["id"] for m in (await c.get("/v1/models", headers=_key("sk-big"))).json()["data"]]
        assert "tiny-llama" in ids

        # requests per minute: 3, then a 429 with Retry-After
        codes = [
            (await c.post("/v1/completions", json=ASK, headers=_key("sk-limited"))).status_code
            for _ in range(4)
        ]
        assert codes == [200, 200, 200, 429]
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-limited"))
        assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        # the other tenants are not affected
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-big"))
        assert r.status_code == 200


async def test_without_keys_the_server_is_open_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = load_settings(telemetry={"devices": "sim:1x8GiB"})
    async with serving(create_app(settings, table=fake_table())) as (c, _):
        assert (await c.post("/v1/completions", json=ASK)).status_code == 200
    assert sum("open to anyone" in r.getMessage() for r in caplog.records) == 1


async def test_a_concurrency_cap_holds_under_load(tenants_file: Path) -> None:
    slow = {n: FakeEngine(token_delay_s=0.05) for n in ("f16", "q8_0", "q4_k_m")}
    settings = load_settings(
        auth={"tenants_file": str(tenants_file)}, telemetry={"devices": "sim:1x8GiB"}
    )
    async with serving(create_app(settings, table=fake_table(slow))) as (c, _):
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, sum(e.in_flight for e in slow.values()))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(
            *(c.post("/v1/completions", json=ASK, headers=_key("sk-single")) for _ in range(6))
        )
        watcher.cancel()
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 1 and set(codes) <= {200, 429}
        assert codes.count(429) >= 4  # one at a time: the others are told at once
        assert peak == 1  # never two of its requests on the engines at once


async def test_a_flood_gets_200s_or_fast_503s_with_retry_after() -> None:
    engines = {n: FakeEngine(token_delay_s=0.02) for n in ("f16",)}
    settings = load_settings(
        telemetry={"devices": "sim:1x8GiB"},
        admission={"queue_size": 4, "slots_factor": 0.05},  # capacity: 64 slots x 0.05 = 3
    )
    async with serving(create_app(settings, table=fake_table(engines))) as (c, _):

        async def one() -> tuple[int, float, str | None]:
            started = time.perf_counter()
            r = await c.post("/v1/completions", json=ASK | {"max_tokens": 5})
            return r.status_code, time.perf_counter() - started, r.headers.get("retry-after")

        results = await asyncio.gather(*(one() for _ in range(40)))
        codes = {code for code, _, _ in results}
        assert codes <= {200, 503} and 200 in codes and 503 in codes
        rejected = sorted(t for code, t, _ in results if code == 503)
        assert all(after for code, _, after in results if code == 503)
        p99 = rejected[min(len(rejected) - 1, int(0.99 * len(rejected)))]
        assert p99 < 0.05, f"p99 of rejections {p99 * 1000:.1f} ms"
        assert statistics.median(t for code, t, _ in results if code == 200) > 0.05
        # and the next request succeeds
        assert (await c.post("/v1/completions", json=ASK)).status_code == 200


async def test_the_status_page_lists_other_tenants_requests_to_the_admin_only(
    tenants_file: Path,
) -> None:
    from qrtest import ADMIN, ADMIN_KEY

    settings = load_settings(
        auth={"tenants_file": str(tenants_file), "protect_metrics": True},
        server={"admin_key": ADMIN_KEY},
        telemetry={"devices": "sim:1x8GiB"},
    )
    async with serving(create_app(settings, table=fake_table())) as (c, _):
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-big"))
        assert r.status_code == 200
        assert (await c.get("/dashboard/data")).status_code == 401  # protected
        tenant = (await c.get("/dashboard/data", headers=_key("sk-limited"))).json()
        admin = (await c.get("/dashboard/data", headers=ADMIN)).json()
        assert tenant["requests"] == admin["requests"] == 1  # counts, for anyone with a key
        assert tenant["recent"] == [] and len(admin["recent"]) == 1  # requests: the admin's
        # the page reads the model list with the same key: the admin key reads it too (all
        # models), and still cannot generate (it is no tenant's)
        assert (await c.get("/v1/models")).status_code == 401
        listed = (await c.get("/v1/models", headers=ADMIN)).json()
        assert "tiny-llama" in [m["id"] for m in listed["data"]]
        assert (await c.get("/v1/models/tiny-llama:f16", headers=ADMIN)).status_code == 200
        assert (await c.post("/v1/completions", json=ASK, headers=ADMIN)).status_code == 401

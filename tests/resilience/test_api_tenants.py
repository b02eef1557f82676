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
        # two keys: which one counts would be a guess, so neither does
        for pair in (["Bearer sk-big", "Bearer sk-nope"], ["Bearer sk-nope", "Bearer sk-big"]):
            headers = [("authorization", value) for value in pair]
            r = await c.post("/v1/completions", json=ASK, headers=headers)
            assert r.status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/v1/route/explain", json=ASK)).status_code == 401  # protected
        # what shows every tenant and model needs an operator's key (none is configured)
        for path in ("/metrics", "/dashboard/data", "/v1/devices"):
            for headers in ({}, _key("sk-big")):
                assert (await c.get(path, headers=headers)).status_code == 401, path
        ready = await c.get("/readyz")  # a probe's: its status, and nothing about models
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        assert (await c.get("/healthz")).status_code == 200

        # a tenant sees and uses only its models, and learns nothing of the others: not
        # from a 404's list of models, a pinned branch's list, or an explanation
        assert (await c.get("/v1/models", headers=_key("sk-other"))).json()["data"] == []
        for model in ("tiny-llama", "tiny-llama:nope", "tiny-llama:f16", "nope"):
            for path in ("/v1/completions", "/v1/route/explain"):
                r = await c.post(path, json=ASK | {"model": model}, headers=_key("sk-other"))
                assert r.status_code == 404, (path, model, r.text)
                assert "tiny-llama" not in r.text and "f16" not in r.text, r.text
                assert r.json()["error"]["param"] == "model"
        r = await c.post("/v1/completions", json=ASK | {"model": "nope"}, headers=_key("sk-big"))
        assert r.status_code == 404 and "tiny-llama" in r.json()["error"]["message"]
        r = await c.post("/v1/route/explain", json=ASK, headers=_key("sk-big"))
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
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


async def test_the_status_page_and_metrics_are_for_the_admin_and_metrics_keys_only(
    tenants_file: Path,
) -> None:
    from qrtest import ADMIN, ADMIN_KEY

    metrics_key = _key("sk-scraper")
    settings = load_settings(
        auth={"tenants_file": str(tenants_file)},
        server={"admin_key": ADMIN_KEY, "metrics_key": "sk-scraper"},
        telemetry={"devices": "sim:1x8GiB"},
    )
    async with serving(create_app(settings, table=fake_table())) as (c, _):
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-big"))
        assert r.status_code == 200
        for path in ("/dashboard/data", "/metrics", "/v1/devices"):
            assert (await c.get(path)).status_code == 401, path
            assert (await c.get(path, headers=_key("sk-limited"))).status_code == 401, path
            assert (await c.get(path, headers=_key("sk-scrape"))).status_code == 401, path
            assert (await c.get(path, headers=ADMIN)).status_code == 200, path
            assert (await c.get(path, headers=metrics_key)).status_code == 200, path
        admin = (await c.get("/dashboard/data", headers=ADMIN)).json()
        scraper = (await c.get("/dashboard/data", headers=metrics_key)).json()
        assert admin["requests"] == scraper["requests"] == 1
        assert len(admin["recent"]) == len(scraper["recent"]) == 1
        metrics = (await c.get("/metrics", headers=metrics_key)).text
        assert 'tenant="big"' in metrics
        full = (await c.get("/readyz", headers=metrics_key)).json()
        assert full["status"] == "ready" and "tiny-llama" in full["ready_branches"]
        # the page reads the model list with the same key: both read it (all models), and
        # neither can generate (neither is a tenant's) nor act (the metrics key)
        assert (await c.get("/v1/models")).status_code == 401
        for key in (ADMIN, metrics_key):
            listed = (await c.get("/v1/models", headers=key)).json()
            assert "tiny-llama" in [m["id"] for m in listed["data"]]
            assert (await c.get("/v1/models/tiny-llama:f16", headers=key)).status_code == 200
            assert (await c.post("/v1/completions", json=ASK, headers=key)).status_code == 401
        assert (await c.get("/admin/status", headers=metrics_key)).status_code == 401


async def test_with_protect_metrics_off_metrics_are_open_but_requests_stay_private(
    tenants_file: Path,
) -> None:
    settings = load_settings(
        auth={"tenants_file": str(tenants_file), "protect_metrics": False},
        telemetry={"devices": "sim:1x8GiB"},
    )
    async with serving(create_app(settings, table=fake_table())) as (c, _):
        r = await c.post("/v1/completions", json=ASK, headers=_key("sk-big"))
        assert r.status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/v1/devices")).status_code == 200
        assert "ready_branches" in (await c.get("/readyz")).json()
        data = (await c.get("/dashboard/data")).json()
        assert data["requests"] == 1 and data["recent"] == []  # the list: operators' only

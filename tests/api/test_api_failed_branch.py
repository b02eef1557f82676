"""A branch whose worker keeps dying fails alone, in words; the others serve.

The worker of q8_0 is started with fault injection: it kills itself with SIGILL
right before its first decode, as a llama.cpp build with instructions the CPU
lacks does (ggml's AMX kernels on an Intel Xeon, say). Real workers, real app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import ADMIN, ADMIN_KEY, demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.api.gateway import Gateway
from quantroute.config import load_settings

pytestmark = pytest.mark.slow

SIGILL_WORDS = (
    "illegal instruction (SIGILL): this llama.cpp build uses CPU instructions this machine "
    "does not allow; see docs/troubleshooting.md#sigill"
)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    settings = load_settings(
        repo=demo_repo_copy(tmp_path),
        server={"admin_key": ADMIN_KEY},
        engine={
            "parallel": 2,
            "n_threads": 1,
            "n_ctx": 512,
            "restart_backoff_s": 0.05,
            "faults": {"q8_0": "sigill-at-first-decode"},
        },
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as pair:
        yield pair


async def _branch(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    body = (await client.get("/v1/models")).json()
    model = next(m for m in body["data"] if m["id"] == "tiny-llama")
    return next(b for b in model["branches"] if b["branch"] == name)


async def _until_failed(client: httpx.AsyncClient, name: str, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if (await _branch(client, name))["state"] == "failed":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never failed")


async def test_sigill_fails_its_branch_in_words_and_the_others_serve(
    server: tuple[httpx.AsyncClient, Gateway], caplog: pytest.LogCaptureFixture
) -> None:
    client, gateway = server
    await _until_failed(client, "q8_0")
    q8 = await _branch(client, "q8_0")
    assert q8["failure"].startswith(SIGILL_WORDS) and "3 times" in q8["failure"]
    assert not q8["ready"]
    assert "exit -4" not in q8["failure"]
    for name in ("f16", "q4_k_m"):
        assert (await _branch(client, name))["state"] == "ready"

    ready = await client.get("/readyz")
    assert ready.status_code == 200  # every model still has a branch
    assert ready.json()["failed_branches"]["tiny-llama"]["q8_0"].startswith(SIGILL_WORDS)
    assert "q8_0" not in ready.json()["ready_branches"]["tiny-llama"]

    devices = (await client.get("/v1/devices")).json()
    assert devices["branches"]["tiny-llama:q8_0"]["state"] == "failed"
    assert devices["branches"]["tiny-llama:q8_0"]["failure"].startswith(SIGILL_WORDS)
    assert (
        'quantroute_branch_failed{branch="q8_0",model="tiny-llama"} 1.0'
        in (await client.get("/metrics")).text
    )
    assert any(SIGILL_WORDS in r.getMessage() for r in caplog.records)

    # it stays down: no restarts while failed
    engine = gateway.routes.current.models["tiny-llama"].branch("q8_0")
    assert engine is not None
    restarts = engine.engine.restarts  # type: ignore[attr-defined]
    await asyncio.sleep(0.5)
    assert engine.engine.restarts == restarts  # type: ignore[attr-defined]

    # routing never offers it; a pin is a 503 that says so; the rest is served
    for quality in ("fast", "balanced", "high", None):
        ask: dict[str, Any] = {"model": "tiny-llama", "prompt": "def ", "max_tokens": 2}
        if quality:
            ask["quality"] = quality
        r = await client.post("/v1/completions", json=ask)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] != "tiny-llama:q8_0"
    pinned = await client.post(
        "/v1/completions", json={"model": "tiny-llama:q8_0", "prompt": "x", "max_tokens": 1}
    )
    assert pinned.status_code == 503 and "retry-after" in pinned.headers
    explain = await client.post("/v1/route/explain", json={"model": "tiny-llama", "prompt": "def "})
    q8_filters = next(b for b in explain.json()["branches"] if b["branch"] == "tiny-llama:q8_0")
    assert q8_filters["filters"][0] == {"name": "ready", "passed": False, "reason": "not ready"}


async def test_an_operator_restarts_a_failed_branch_with_the_admin_key(
    server: tuple[httpx.AsyncClient, Gateway],
) -> None:
    client, gateway = server
    await _until_failed(client, "q8_0")
    path = "/admin/branches/tiny-llama:q8_0/restart"
    assert (await client.post(path, json={})).status_code == 401
    wrong = await client.post(path, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "nope" not in wrong.text
    model_only = await client.post("/admin/branches/tiny-llama/restart", headers=ADMIN)
    assert model_only.status_code == 400
    assert (await client.post("/admin/branches/nope:x/restart", headers=ADMIN)).status_code == 404

    # the fault is still injected, so the restart fails again, three more times
    engine = gateway.routes.current.models["tiny-llama"].branch("q8_0")
    assert engine is not None
    before = engine.engine.restarts  # type: ignore[attr-defined]
    r = await client.post(path, headers=ADMIN)
    assert r.status_code == 200 and r.json()["branch"] == "tiny-llama:q8_0"
    await _until_failed(client, "q8_0")
    assert engine.engine.restarts > before  # type: ignore[attr-defined]


async def test_admin_endpoints_are_closed_without_an_admin_key(tmp_path: Path) -> None:
    from qrtest import fake_table

    app = create_app(load_settings(telemetry={"devices": "sim:1x8GiB"}), table=fake_table())
    async with serving(app) as (client, _):
        for method, path, body in (
            ("POST", "/admin/branches/tiny-llama:f16/restart", None),
            ("PUT", "/admin/devices/sim:0/pressure", {"bytes": 1}),
        ):
            r = await client.request(method, path, json=body, headers=ADMIN)
            assert r.status_code == 403, path
            assert r.json()["error"]["type"] == "permission_error"
            assert ADMIN_KEY not in r.text

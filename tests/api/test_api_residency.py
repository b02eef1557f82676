"""The residency manager on real workers and a simulated device: branches leave
when memory runs out and come back when it returns, and routing follows. (The demo's
GGUF branches alone: three sizes make each step of the policy one branch to watch.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import ADMIN_KEY, demo_repo_copy, serving, set_headroom
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.base import FinishEvent, GenerationRequest, SamplingParams, StartEvent

pytestmark = pytest.mark.slow
GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=demo_repo_copy(tmp_path, engine="llamacpp"),
        engine={"parallel": 2, "n_threads": 1},
        # weights x 100, so the precisions differ in size beyond the noise of measured RSS
        telemetry={"devices": "sim:1x8GiB", "poll_interval_s": 0.5, "sim_weight_scale": 100},
        # the test drives each round itself
        routing={"residency": False, "reload_margin_bytes": 16 * MiB},
        drift={"fraction": 0.0},  # a replay would hold a branch busy and delay its unload
    )
    async with serving(create_app(settings)) as pair:
        yield pair


async def _branch(client: httpx.AsyncClient, **extra: Any) -> str:
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "fast"} | extra,
    )
    assert r.status_code == 200, r.text
    return str(r.headers["x-quantroute-branch"]).split(":")[1]


async def test_branches_leave_under_pressure_and_return(
    client: tuple[httpx.AsyncClient, Any],
) -> None:
    http, gateway = client
    engines = {b.name: b.engine for b in gateway.routes.current.branches()}
    for _ in range(3):  # q4_k_m is the one in use: it is the last to go
        assert await _branch(http, model="tiny-llama:q4_k_m") == "q4_k_m"
    f16_bytes = gateway.occupancy.device_bytes(
        gateway.occupancy.placements["tiny-llama:f16"].footprint
    )
    await set_headroom(http, gateway, -MiB)  # 1 MiB over budget: one cold branch must go
    plan = await gateway.residency.apply()
    assert plan.unload == ("tiny-llama:f16",) and not engines["f16"].ready
    assert "tiny-llama:f16" not in gateway.occupancy.sim.attached("sim:0")
    assert await _branch(http) != "f16"
    await set_headroom(http, gateway, -512 * MiB)  # deep pressure: all but one go
    plan = await gateway.residency.apply()
    assert plan.unload == ("tiny-llama:q8_0",)
    assert [n for n, e in engines.items() if e.ready] == ["q4_k_m"]
    # The model keeps its last branch, but a device over budget cannot take a request:
    # routing finds no room (503), and a pinned request fails as its allocation would.
    r = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    r = await http.post("/v1/completions", json={"model": "tiny-llama:q4_k_m", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "device_out_of_memory"
    await set_headroom(http, gateway, 8 * MiB)  # within budget again, no room for more
    assert not await gateway.residency.apply()
    assert await _branch(http) == "q4_k_m"
    # Room again (f16's footprint + the reload margin): the most faithful comes back first.
    await set_headroom(http, gateway, f16_bytes + 32 * MiB)
    plan = await gateway.residency.apply()
    assert plan.load == ("tiny-llama:f16",) and engines["f16"].ready
    assert await _branch(http, quality="exact") == "f16"  # routable again (warm)
    assert "tiny-llama:f16" in gateway.occupancy.sim.attached("sim:0")


async def test_a_busy_branch_drains_before_it_is_unloaded(
    client: tuple[httpx.AsyncClient, Any],
) -> None:
    http, gateway = client
    engine = gateway.routes.current.models["tiny-llama"].branch("f16").engine
    for name in ("q8_0", "q4_k_m"):  # in use: warmer than f16
        assert await _branch(http, model=f"tiny-llama:{name}") == name
    # A long generation in flight on f16 (ASGI test transports buffer whole responses,
    # so it is driven on the engine directly).
    request = GenerationRequest("long", "x", SamplingParams(max_tokens=400, ignore_eos=True))
    stream = engine.generate(request)
    assert isinstance(await anext(stream), StartEvent)
    await set_headroom(http, gateway, -MiB)
    plan = await gateway.residency.apply()
    assert plan.unload == ("tiny-llama:f16",)
    assert engine.ready and engine.in_flight == 1  # draining, not cut
    assert not gateway.residency.routable(gateway.routes.current.models["tiny-llama"].branch("f16"))
    events = [e async for e in stream]
    assert isinstance(events[-1], FinishEvent) and events[-1].completion_tokens == 400
    await gateway.residency.apply()
    assert not engine.ready


async def test_scaled_weights_and_out_of_memory_until_residency_acts(tmp_path: Path) -> None:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=demo_repo_copy(tmp_path, engine="llamacpp"),
        engine={"parallel": 2, "n_threads": 1},
        telemetry={"devices": "sim:1x24GiB", "sim_weight_scale": 2000},
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as (http, gateway):
        await gateway.poller.poll_once()
        branches = (await http.get("/v1/devices")).json()["branches"]
        on_device = {k.split(":")[1]: v["footprint"]["device_bytes"] for k, v in branches.items()}
        # weights x 2000: f16 ~7.5 GB, q8_0 ~4 GB, q4_k_m ~2.3 GB, as for a ~3.8 B model
        assert on_device["f16"] > 7 * GiB > on_device["q8_0"] > 3.5 * GiB > on_device["q4_k_m"]
        used = gateway.poller.snapshot.device("sim:0").used_bytes
        assert used == sum(on_device.values())
        await set_headroom(http, gateway, -MiB)  # over budget: allocations fail
        r = await http.post(
            "/v1/completions", json={"model": "tiny-llama:q8_0", "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "device_out_of_memory"
        plan = await gateway.residency.apply()
        assert plan.unload == ("tiny-llama:f16",)  # the coldest and largest goes
        await gateway.poller.poll_once()
        r = await http.post(
            "/v1/completions", json={"model": "tiny-llama:q8_0", "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 200

"""Device telemetry wired into the gateway: placement, footprints, sim accounting, health."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import ADMIN, ADMIN_KEY, demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = pytest.mark.slow
GiB = 1 << 30


@pytest.fixture
async def sim_client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1, "restart_backoff_s": 0.1},
        telemetry={"devices": "sim:2x24GiB", "poll_interval_s": 0.5},
    )
    async with serving(create_app(settings)) as pair:
        yield pair


async def _until(predicate: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_branches_are_placed_measured_and_accounted(
    sim_client: tuple[httpx.AsyncClient, Any],
) -> None:
    client, gateway = sim_client
    await _until(
        lambda: all(p.footprint.measured_bytes for p in gateway.occupancy.placements.values())
    )
    await gateway.poller.poll_once()
    body = (await client.get("/v1/devices")).json()
    assert body["provider"] == "sim" and not body["stale"]
    branches = body["branches"]
    names = ("f16", "q8_0", "q4_k_m", "onnx_fp16", "onnx_int8", "onnx_int4")
    assert set(branches) == {f"tiny-llama:{n}" for n in names}  # both engines' workers
    for view in branches.values():
        fp = view["footprint"]
        assert view["device"] in ("sim:0", "sim:1") and view["ready"]
        assert abs(fp["estimated_bytes"] - fp["measured_bytes"]) <= 0.25 * fp["measured_bytes"]
        assert fp["weights_bytes"] > 0 and fp["kv_bytes"] > 0
    # Placement spreads by headroom: both devices are used, and used memory is what is attached.
    devices = {d["id"]: d for d in body["data"]}
    assert all(devices[i]["branches"] for i in ("sim:0", "sim:1"))
    for device_id, device in devices.items():
        attached = sum(
            b["footprint"]["bytes"] for b in branches.values() if b["device"] == device_id
        )
        assert device["memory"]["used_bytes"] == attached


async def test_pressure_moves_free_memory_and_is_sim_only(
    sim_client: tuple[httpx.AsyncClient, Any],
) -> None:
    client, gateway = sim_client
    r = await client.put("/admin/devices/sim:1/pressure", json={"bytes": 20 * GiB}, headers=ADMIN)
    assert r.status_code == 200
    await gateway.poller.poll_once()
    device = next(d for d in (await client.get("/v1/devices")).json()["data"] if d["id"] == "sim:1")
    assert device["memory"]["free_bytes"] < 4 * GiB
    assert (
        await client.put("/admin/devices/sim:9/pressure", json={"bytes": 1}, headers=ADMIN)
    ).status_code == 404
    bad = await client.put("/admin/devices/sim:1/pressure", json={"bytes": -1}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bytes"
    # a form's content type, as curl -d sends: still read as JSON
    form = {"content-type": "application/x-www-form-urlencoded"} | ADMIN
    r = await client.put("/admin/devices/sim:1/pressure", content=b'{"bytes": 0}', headers=form)
    assert r.status_code == 200 and r.json() == {"device": "sim:1", "pressure_bytes": 0}
    for content, param in ((b'{"bytes": "x"}', "bytes"), (b"[1]", None), (b"", None)):
        r = await client.put("/admin/devices/sim:1/pressure", content=content, headers=ADMIN)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, error
        assert error["type"] == "invalid_request_error"


async def test_a_dead_worker_leaves_its_device_and_lowers_its_health(
    sim_client: tuple[httpx.AsyncClient, Any],
) -> None:
    _client, gateway = sim_client
    await _until(
        lambda: all(p.footprint.measured_bytes for p in gateway.occupancy.placements.values())
    )
    placement = gateway.occupancy.placements["tiny-llama:q8_0"]
    engine = gateway.routes.current.models["tiny-llama"].branch("q8_0").engine
    before = gateway.occupancy.sim.attached(placement.device)
    assert "tiny-llama:q8_0" in before
    os.kill(engine.pid, signal.SIGKILL)
    await _until(lambda: "tiny-llama:q8_0" not in gateway.occupancy.sim.attached(placement.device))
    assert gateway.health.factor(placement.device) < 1.0
    await _until(
        lambda: (
            engine.ready and "tiny-llama:q8_0" in gateway.occupancy.sim.attached(placement.device)
        )
    )


def test_devices_command_prints_a_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quantroute.cli", "devices", "--devices", "sim:2x24GiB;nvlink=0-1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "sim:0" in out and "24.0 GiB" in out and "NV1" in out
    local = subprocess.run(
        [sys.executable, "-m", "quantroute.cli", "devices", "--devices", "cpu", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"id": "cpu"' in local


async def test_workers_are_pinned_to_their_configured_cores(tmp_path: Path) -> None:
    import psutil

    repo = demo_repo_copy(tmp_path)
    cores = sorted(os.sched_getaffinity(0))
    plan = [[cores[0]], [cores[-1]], [cores[0]], [cores[-1]], [cores[0]], [cores[-1]]]
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=repo,
        engine={"parallel": 1},
        telemetry={"devices": "cpu", "cpu_affinity": plan},
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        branches = app.state.gateway.routes.current.branches()
        assert [(b.name, b.artifact.engine) for b in branches] == [  # most faithful first
            ("f16", "llamacpp"),
            ("onnx_fp16", "onnxruntime"),  # ONNX Runtime's workers are pinned alike
            ("onnx_int8", "onnxruntime"),
            ("q8_0", "llamacpp"),
            ("onnx_int4", "onnxruntime"),
            ("q4_k_m", "llamacpp"),
        ]
        for branch, cpus in zip(branches, plan, strict=True):
            assert psutil.Process(branch.engine.pid).cpu_affinity() == cpus


async def test_device_gauges_are_exported(sim_client: tuple[httpx.AsyncClient, Any]) -> None:
    client, gateway = sim_client
    await client.put("/admin/devices/sim:1/pressure", json={"bytes": 20 * GiB}, headers=ADMIN)
    await gateway.poller.poll_once()
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    gauges = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in r.text.splitlines()
        if line.startswith("quantroute_device_")
    }
    assert gauges['quantroute_device_total_bytes{device="sim:0",kind="sim"}'] == 24 * GiB
    assert gauges['quantroute_device_free_bytes{device="sim:1",kind="sim"}'] < 4 * GiB
    assert gauges['quantroute_device_health{device="sim:0"}'] == 1.0
    assert 'quantroute_branch_ready{branch="f16",model="tiny-llama",precision="f16"} 1.0' in r.text

"""The drift monitor on real workers: a branch whose weights were damaged after it
was profiled is flagged; a healthy one is not. (The damage is the fault injected:
the worker serves a perturbed copy of f16 under q4_k_m's name and profile.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import demo_model_dir
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.demo.gguf_export import perturb_gguf_weights
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.quality.profile import load_profiles
from quantroute.registry.manifest import load_manifest, verify_artifacts
from quantroute.routing.table import Branch, ModelRoute, RouteTable

pytestmark = pytest.mark.slow

PROMPTS = ["def ", "class Parser:\n", "import os\n", "    return ", "for key in ", "if not "]


def _table(damaged_file: Path) -> RouteTable:
    directory = demo_model_dir()
    artifacts = verify_artifacts(directory, load_manifest(directory))
    profiles, _ = load_profiles(directory, artifacts)
    branches = []
    for a in artifacts:
        path = damaged_file if a.name == "q4_k_m" else a.path
        engine = LlamaCppEngine(
            a.model + ":" + a.name, path, WorkerOptions(parallel=2, n_threads=1), RestartPolicy()
        )
        branches.append(Branch(a.model, a.name, a.precision, a, engine, profiles[a.name]))
    return RouteTable.build([ModelRoute("tiny-llama", "f16", tuple(branches))])


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damaged") / "f16-noisy.gguf"
    perturb_gguf_weights(demo_model_dir() / "f16.gguf", path, scale=0.3, seed=7)
    return path


@pytest.fixture
async def client(damaged: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = load_settings(
        telemetry={"devices": "cpu"},
        drift={
            "fraction": 1.0,
            "window_tokens": 48,
            "windows_to_flag": 2,
            "windows_to_recover": 2,
            "queue": 64,
        },
    )
    app = create_app(settings, _table(damaged))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app.state.gateway


async def _serve(client: httpx.AsyncClient, branch: str, rounds: int) -> None:
    for i in range(rounds):
        r = await client.post(
            "/v1/completions",
            json={
                "model": f"tiny-llama:{branch}",
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": 32,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200


async def _drift(client: httpx.AsyncClient, branch: str) -> dict[str, Any]:
    models = (await client.get("/v1/models")).json()["data"][0]["branches"]
    return next(b["drift"] for b in models if b["branch"] == branch)


async def test_damaged_branch_is_flagged_and_healthy_one_is_not(
    client: tuple[httpx.AsyncClient, Any],
) -> None:
    http, gateway = client
    await _serve(http, "q8_0", 12)
    await _serve(http, "q4_k_m", 12)
    for _ in range(200):
        a, b = await _drift(http, "q8_0"), await _drift(http, "q4_k_m")
        if a["windows"] >= 4 and b["degraded"]:
            break
        await asyncio.sleep(0.05)
    healthy, damaged = await _drift(http, "q8_0"), await _drift(http, "q4_k_m")
    assert healthy["windows"] >= 4 and not healthy["degraded"]
    assert healthy["last_window"]["in_bounds"]
    assert damaged["degraded"]
    assert damaged["last_window"]["mean_kld"] > 0.05 + 0.0103  # above its profile + δ
    # The verdict reaches routing: the service's policy sees the branch as degraded.
    assert gateway.drift.degraded("tiny-llama:q4_k_m") and not gateway.drift.degraded(
        "tiny-llama:q8_0"
    )


async def test_drift_verdict_is_a_prometheus_metric(
    client: tuple[httpx.AsyncClient, Any],
) -> None:
    http, _ = client
    await _serve(http, "q4_k_m", 12)
    for _ in range(200):
        if (await _drift(http, "q4_k_m"))["degraded"]:
            break
        await asyncio.sleep(0.05)
    text = (await http.get("/metrics")).text
    assert 'quantroute_branch_degraded{branch="q4_k_m",model="tiny-llama"} 1.0' in text
    assert 'quantroute_branch_degraded{branch="q8_0",model="tiny-llama"} 0.0' in text
    assert "quantroute_branch_drift_window_kld{" in text

"""A manifest's ``device:`` pins its branch, in a real server over the demo model's
workers on simulated devices: the pinned device though another has more room, and a
device the server lacks fails that branch alone, in words, while the others serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from qrtest import ADMIN, demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = pytest.mark.slow


def _pin(repo: Path, pins: dict[str, str]) -> None:
    manifest = repo / "tiny-llama" / "quantroute.yaml"
    text = manifest.read_text()
    for branch, device in pins.items():
        text = text.replace(
            f"  {branch}:\n    file:", f"  {branch}:\n    device: {device}\n    file:", 1
        )
    manifest.write_text(text)


async def test_pinned_branches_run_where_their_manifest_says(tmp_path: Path) -> None:
    repo = demo_repo_copy(tmp_path)
    _pin(repo, {"f16": "sim:1", "q4_k_m": "sim:5"})
    settings = load_settings(
        repo=repo,
        engine={"parallel": 1, "n_threads": 1, "n_ctx": 256},
        telemetry={"devices": "sim:2x24GiB"},
        server={"admin_key": ADMIN["authorization"].removeprefix("Bearer ")},
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as (client, _):
        devices = (await client.get("/v1/devices", headers=ADMIN)).json()["branches"]
        assert devices["tiny-llama:f16"]["device"] == "sim:1"  # pinned, though sim:0 is as empty
        assert devices["tiny-llama:q8_0"]["device"] == "sim:0"  # unpinned: the roomiest
        readiness = (await client.get("/readyz", headers=ADMIN)).json()
        failed = readiness["failed_branches"]["tiny-llama"]
        assert failed == {
            "q4_k_m": "its manifest's device sim:5 is not one of this server's (sim:0, sim:1)"
        }
        ask = {"model": "tiny-llama:f16", "prompt": "def ", "max_tokens": 2}
        r = await client.post("/v1/completions", json=ask)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:f16"
        r = await client.post("/v1/completions", json=ask | {"model": "tiny-llama:q4_k_m"})
        assert r.status_code == 503

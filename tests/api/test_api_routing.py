"""The routing policy through the real app: real workers on a simulated device whose
free memory the test moves, with the demo's measured profiles."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import ADMIN_KEY, demo_repo_copy, serving, set_headroom
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = pytest.mark.slow
GiB = 1 << 30


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1},
        telemetry={"devices": "sim:1x24GiB", "poll_interval_s": 0.5},
    )
    async with serving(create_app(settings)) as pair:
        yield pair


async def _free(client: httpx.AsyncClient, gateway: Any, headroom: int) -> None:
    await set_headroom(client, gateway, headroom)
    device = gateway.poller.snapshot.device("sim:0")
    assert abs(gateway.margin.headroom(device) - headroom) < 2 * GiB // 100


@pytest.mark.parametrize(
    ("headroom", "quality", "branch"),
    [
        # both engines' branches on one ladder: ONNX int8 (KLD 3.3e-4) is more faithful
        # than GGUF q8_0 (3.6e-4), ONNX int4 (1.0e-2) than GGUF q4_k_m (1.4e-2)
        (10 * GiB, None, "f16"),
        (8 * GiB + (64 << 20), None, "f16"),
        (6 * GiB, None, "onnx_int8"),
        (4 * GiB + (64 << 20), None, "onnx_int8"),
        (3 * GiB, None, "onnx_int4"),
        (3 * GiB, "below-q8_0", "f16"),  # only f16 and onnx_fp16 meet it: the reference
        (6 * GiB, "high", "onnx_int8"),
        (3 * GiB, "high", "onnx_int8"),  # neither 4-bit branch meets "high"
        (10 * GiB, "fast", "f16"),
    ],
)
async def test_memory_and_quality_choose_the_branch(
    client: tuple[httpx.AsyncClient, Any], headroom: int, quality: object, branch: str
) -> None:
    http, gateway = client
    await _free(http, gateway, headroom)
    body: dict[str, Any] = {"model": "tiny-llama", "prompt": "def ", "max_tokens": 4}
    if quality == "below-q8_0":  # a bound between f16's KLD (0) and q8_0's measured KLD
        branches = (await http.get("/v1/models")).json()["data"][0]["branches"]
        q8 = next(b for b in branches if b["branch"] == "q8_0")["profile"]["mean_kld"]
        quality = {"max_kld": q8 / 2}
    if quality is not None:
        body["quality"] = quality
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-quantroute-branch"] == f"tiny-llama:{branch}"
    assert r.headers["x-quantroute-route-reason"]


async def test_quality_header_and_explain(client: tuple[httpx.AsyncClient, Any]) -> None:
    http, gateway = client
    await _free(http, gateway, 3 * GiB)
    r = await http.post(
        "/v1/completions",
        json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2},
        headers={"x-quantroute-quality": "max_kld=0.001"},
    )
    # ONNX int8 (KLD 3.3e-4, 9.25 bits a weight) and GGUF q8_0 (3.6e-4, 8.5) both meet the
    # bound: on one quality axis, the more faithful serves, whichever its engine (a level
    # up the ladder outweighs 9 % more bits)
    assert r.headers["x-quantroute-branch"] == "tiny-llama:onnx_int8"
    explained = (
        await http.post(
            "/v1/route/explain",
            json={
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "hi"}],
                "quality": "high",
            },
        )
    ).json()
    assert explained["requirement"]["tier"] == "high"
    assert explained["decision"]["branches"][0] == "tiny-llama:onnx_int8"
    by_branch = {b["branch"]: b for b in explained["branches"]}
    engines = {b.split(":")[1]: v["engine"] for b, v in by_branch.items()}  # the manifest's
    assert engines == {
        "f16": "llamacpp",
        "q8_0": "llamacpp",
        "q4_k_m": "llamacpp",
        "onnx_fp16": "onnxruntime",
        "onnx_int8": "onnxruntime",
        "onnx_int4": "onnxruntime",
    }
    for low in ("q4_k_m", "onnx_int4"):  # too far from the reference, whichever engine
        row = by_branch[f"tiny-llama:{low}"]
        assert not row["feasible"]
        assert any(f["name"] == "quality" and not f["passed"] for f in row["filters"])
    assert by_branch["tiny-llama:onnx_int8"]["regime"] == "tight"
    assert by_branch["tiny-llama:q8_0"]["feasible"]  # a fallback
    # each branch's place in the decision: the primary 0, its fallbacks 1.., the rest none
    places = {b: i for i, b in enumerate(explained["decision"]["branches"])}
    assert len(places) >= 2, explained["decision"]
    assert {b["branch"]: b["position"] for b in explained["branches"]} == {
        b: places.get(b) for b in by_branch
    }


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"quality": "excellent"}, {}, "quality"),
        ({"quality": {"max_kld": -1}}, {}, "quality"),
        ({"quality": {"nonsense": 1}}, {}, "quality"),
        ({}, {"x-quantroute-quality": "max_kld=abc"}, "x-quantroute-quality"),
        ({}, {"x-quantroute-deadline-ms": "0"}, "x-quantroute-deadline-ms"),
        ({"timeout": "soon"}, {}, "timeout"),
    ],
)
async def test_bad_requirements_are_400(
    client: tuple[httpx.AsyncClient, Any],
    body: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    http, _ = client
    r = await http.post(
        "/v1/completions",
        headers=headers,
        json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2} | body,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
    assert "excellent" not in r.json()["error"]["message"]

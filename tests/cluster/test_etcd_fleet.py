"""A fleet of real gateway processes (``quantroute serve`` on the demo model, with a second
version) sharing one real etcd: a drain on one gateway refuses ``exact`` requests on the
other within a second; an ``etcdctl put`` of a traffic rule takes effect on both; etcd
killed and restarted: serving never stops, ``/admin/status`` says degraded, and the state
converges once etcd is back."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cluster_servers import EtcdServer, etcd_server, eventually, needs_etcd
from qrtest import ADMIN, ADMIN_KEY, demo_model_dir, serve_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e, needs_etcd]

NAME = "fleet"
MODEL = "tiny-llama"
EXACT = {"model": MODEL, "prompt": "def ", "max_tokens": 2, "quality": "exact"}
FAST = {"model": MODEL, "prompt": "def ", "max_tokens": 2, "quality": "fast"}


def versioned_repo(root: Path) -> Path:
    """The demo model with a second version, ``v2``: its q4_k_m file alone."""
    folder = root / "repo" / MODEL
    shutil.copytree(demo_model_dir(), folder)
    manifest = yaml.safe_load((folder / "quantroute.yaml").read_text())
    q4 = manifest["branches"]["q4_k_m"]
    manifest["versions"] = {"v2": {"reference": "q4_k_m", "branches": {"q4_k_m": dict(q4)}}}
    (folder / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert hashlib.sha256((folder / "q4_k_m.gguf").read_bytes()).hexdigest() == q4["sha256"]
    return root / "repo"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, list[str]]]:
    """One etcd and two gateways on it: (etcd, the gateways' base URLs)."""
    root = tmp_path_factory.mktemp("fleet")
    repo = versioned_repo(root)
    flags = ["--cluster-etcd-endpoints", "", "--cluster-name", NAME,
             "--cluster-etcd-probe-interval-s", "0.25", "--cluster-etcd-retry-max-s", "0.5",
             "--server-admin-key", ADMIN_KEY, "--repository-watch", "false"]  # fmt: skip
    with etcd_server(root) as etcd, contextlib.ExitStack() as stack:
        flags[1] = etcd.url
        bases = [stack.enter_context(serve_process(repo, *flags, ready_s=600)) for _ in range(2)]
        yield etcd, bases


async def _post(base: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await client.post("/v1/completions", json=body, headers=headers)


async def _cluster(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        r = await client.get("/admin/status", headers=ADMIN)
    assert r.status_code == 200
    status: dict[str, Any] = r.json()["cluster"]
    return status


async def _admin(base: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await client.post(path, headers=ADMIN)


async def test_a_drain_on_one_gateway_refuses_exact_requests_on_the_other_within_a_second(
    fleet: tuple[EtcdServer, list[str]],
) -> None:
    _, (a, b) = fleet
    r = await _post(b, EXACT)
    assert r.status_code == 200 and r.headers["x-quantroute-branch"] == f"{MODEL}@v1:f16"
    r = await _admin(a, f"/admin/branches/{MODEL}@v1:f16/drain")
    assert r.status_code == 200 and r.json()["store"] == "etcd", r.text
    drained_at = time.monotonic()

    async def refused() -> bool:
        r = await _post(b, EXACT)
        return r.status_code == 503 and f"{MODEL}@v1:f16 is drained" in r.text

    await eventually(refused, within_s=1.0)
    assert time.monotonic() - drained_at < 1.0
    r = await _post(b, FAST)  # the other branches serve on
    assert r.status_code == 200 and r.headers["x-quantroute-branch"] != f"{MODEL}@v1:f16"
    assert (await _cluster(b))["drained"] == {f"{MODEL}@v1:f16": None}
    r = await _admin(b, f"/admin/branches/{MODEL}:f16/drain")  # which version's f16?
    assert r.status_code == 400 and "@<version>" in r.text
    r = await _admin(b, f"/admin/branches/{MODEL}@v1:f16/undrain")
    assert r.status_code == 200 and r.json()["state"] == "active"
    undrained_at = time.monotonic()

    async def served() -> bool:
        r = await _post(a, EXACT)
        return r.status_code == 200 and r.headers["x-quantroute-branch"] == f"{MODEL}@v1:f16"

    await eventually(served, within_s=1.0)
    assert time.monotonic() - undrained_at < 1.0


async def test_an_etcdctl_traffic_rule_takes_effect_on_every_gateway(
    fleet: tuple[EtcdServer, list[str]],
) -> None:
    etcd, bases = fleet
    for base in bases:
        r = await _post(base, FAST, **{"x-ab-group": "b"})
        assert r.headers["x-quantroute-version"] == "v1"  # the manifest has no rule
    rule = {"traffic": [{"version": "v2", "header": "x-ab-group", "value": "b"}]}
    await asyncio.to_thread(etcd.ctl, "put", f"/{NAME}/traffic/{MODEL}", json.dumps(rule))
    put_at = time.monotonic()
    for base in bases:

        async def v2(base: str = base) -> bool:
            r = await _post(base, FAST, **{"x-ab-group": "b"})
            return r.headers.get("x-quantroute-version") == "v2"

        await eventually(v2, within_s=1.0)
        r = await _post(base, FAST, **{"x-ab-group": "a"})
        assert r.headers["x-quantroute-version"] == "v1"
    assert time.monotonic() - put_at < 1.0 * len(bases)
    everyone = {"default_version": "v2", "traffic": []}
    await asyncio.to_thread(etcd.ctl, "put", f"/{NAME}/traffic/{MODEL}", json.dumps(everyone))
    for base in bases:

        async def all_v2(base: str = base) -> bool:
            r = await _post(base, {**FAST, "user": "someone"})
            return r.headers.get("x-quantroute-version") == "v2"

        await eventually(all_v2, within_s=1.0)
        assert (await _cluster(base))["traffic"][MODEL]["default_version"] == "v2"
    await asyncio.to_thread(etcd.ctl, "del", f"/{NAME}/traffic/{MODEL}")  # the manifest's again
    for base in bases:

        async def v1(base: str = base) -> bool:
            r = await _post(base, FAST, **{"x-ab-group": "b"})
            return r.headers.get("x-quantroute-version") == "v1"

        await eventually(v1, within_s=1.0)


async def test_etcd_killed_and_restarted_serving_never_stops_and_the_state_converges(
    fleet: tuple[EtcdServer, list[str]],
) -> None:
    etcd, bases = fleet
    answers: list[int] = []
    stop = asyncio.Event()

    async def keep_asking(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            while not stop.is_set():
                r = await client.post("/v1/completions", json=FAST)
                answers.append(r.status_code)
                await asyncio.sleep(0.02)

    askers = [asyncio.create_task(keep_asking(base)) for base in bases]
    try:
        await asyncio.to_thread(etcd.kill)
        for base in bases:

            async def degraded(base: str = base) -> bool:
                return bool((await _cluster(base))["degraded"])

            await eventually(degraded, within_s=3.0, step_s=0.05)
            status = await _cluster(base)
            assert status["state"] == "degraded" and status["degraded_since"] <= time.time()
        r = await _admin(bases[0], f"/admin/branches/{MODEL}@v1:q8_0/drain")
        assert r.status_code == 503  # not recorded anywhere: refused, not half done
        await asyncio.sleep(1.0)  # a second of serving without etcd
        await asyncio.to_thread(etcd.start)
        for base in bases:

            async def connected(base: str = base) -> bool:
                return (await _cluster(base))["state"] == "connected"

            await eventually(connected, within_s=5.0, step_s=0.05)
        key = f"/{NAME}/branches/{MODEL}@v1:q8_0/admin"
        await asyncio.to_thread(etcd.ctl, "put", key, '{"state": "drained", "reason": "test"}')
        for base in bases:

            async def applied(base: str = base) -> bool:
                return (await _cluster(base))["drained"] == {f"{MODEL}@v1:q8_0": "test"}

            await eventually(applied, within_s=1.0)
        await asyncio.to_thread(etcd.ctl, "del", key)
    finally:
        stop.set()
        await asyncio.gather(*askers)
    assert answers and set(answers) == {200}, sorted(set(answers))

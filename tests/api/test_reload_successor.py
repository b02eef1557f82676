"""A job routed before a reload runs on the id's new worker only where that keeps the
quality it was routed for: a branch whose new file is less faithful (by its profile)
than the one the request's bound was checked against does not take it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qrtest import serving
from quantroute.api.app import create_app
from quantroute.api.runner import Runner, as_faithful
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision

MODEL = "m"
BOUND = 0.005  # the request's max_kld


def _branch(
    name: str, engine: FakeEngine, sha: str, kld: float | None, top1: float = 1.0
) -> Branch:
    artifact = BranchArtifact(
        MODEL, name, Precision(name), "fake", Path(f"/{name}.gguf"), sha, 0, name == "f16"
    )
    profile = (
        None
        if kld is None
        else SimpleNamespace(mean_kld=kld, top1=top1, prefill_tps=1e4, decode_tps=1e3)
    )
    return Branch(MODEL, name, Precision(name), artifact, engine, profile)  # type: ignore[arg-type]


def _table(*branches: Branch) -> RouteTable:
    return RouteTable.build([ModelRoute(MODEL, "f16", branches)])


@pytest.mark.parametrize(
    ("new_kld", "pinned", "answers"),
    [
        (0.05, False, "old"),  # worse than the bound the request was routed under
        (0.0005, False, "new"),  # more faithful: it meets every bound the old one met
        (0.05, True, "new"),  # the client named the branch: whatever the id names now
    ],
)
async def test_a_job_routed_before_a_reload_runs_where_its_bound_still_holds(
    monkeypatch: pytest.MonkeyPatch, new_kld: float, pinned: bool, answers: str
) -> None:
    old, new, reference = FakeEngine(), FakeEngine(), FakeEngine()
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        # every device "tight": the cheapest branch that meets the bound fits best
        routing={"tight_free_bytes": 1 << 50, "ample_free_bytes": 1 << 51},
    )
    f16 = _branch("f16", reference, "a" * 64, None)
    table = _table(f16, _branch("q8_0", old, "b" * 64, 0.001, 0.99))
    gate, held = asyncio.Event(), []
    start = Runner.start

    async def delayed(self: Runner, job: Any) -> Any:
        held.append(job.branches[0].id)
        await gate.wait()
        return await start(self, job)

    monkeypatch.setattr(Runner, "start", delayed)
    body = {
        "model": f"{MODEL}:q8_0" if pinned else MODEL,
        "prompt": "x",
        "max_tokens": 2,
        "quality": {"max_kld": BOUND},
    }
    async with serving(create_app(settings, table=table)) as (client, gateway):
        await new.start()
        pending = asyncio.create_task(client.post("/v1/completions", json=body))
        while not held:  # noqa: ASYNC110 (the hook has no event for it)
            await asyncio.sleep(0.005)
        assert held == [f"{MODEL}:q8_0"]
        # a reload's swap: the id q8_0 now names another file, with its own profile
        gateway.routes.current = _table(f16, _branch("q8_0", new, "c" * 64, new_kld, 0.99))
        gate.set()
        r = await pending
    assert r.status_code == 200, r.text
    assert (len(old.requests), len(new.requests)) == ((1, 0) if answers == "old" else (0, 1))
    assert not reference.requests


def test_as_faithful_compares_files_and_profiles() -> None:
    e = FakeEngine()
    old = _branch("q8_0", e, "b" * 64, 0.001, 0.99)
    assert as_faithful(old, _branch("q8_0", e, "b" * 64, None), reference="f16")  # same file
    assert as_faithful(old, _branch("q8_0", e, "c" * 64, 0.001, 0.99), reference="f16")
    assert not as_faithful(old, _branch("q8_0", e, "c" * 64, 0.002, 0.99), reference="f16")
    assert not as_faithful(old, _branch("q8_0", e, "c" * 64, 0.001, 0.98), reference="f16")
    assert not as_faithful(old, _branch("q8_0", e, "c" * 64, None), reference="f16")
    # the id became the reference: it meets any bound
    assert as_faithful(old, _branch("q8_0", e, "c" * 64, None), reference="q8_0")
    # an unprofiled branch only ever took unbounded requests
    assert as_faithful(
        _branch("q8_0", e, "b" * 64, None), _branch("q8_0", e, "c" * 64, 0.9), reference="f16"
    )
    # the old reference met max_kld 0, which a non-reference never does
    ref = _branch("f16", e, "a" * 64, None)
    assert not as_faithful(ref, _branch("f16", e, "d" * 64, 0.0, 1.0), reference="q8_0")
    assert as_faithful(ref, _branch("f16", e, "d" * 64, None), reference="f16")

"""Hot reload's edges, on real llama.cpp workers: a drain never blocks the next reload
and is stopped exactly once (by itself, or by shutdown); a request routed before the
swap that reaches its branch after the old worker stopped still gets its answer; a
worker stopped for a replaced file is not handed back by a reload; a reload hashes
each file once, and not again while it is unchanged."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from api.test_api_reload import (
    MODEL,
    answering_artifact,
    one_branch_repo,
    replace_file,
    settings_for,
    stream_once,
    write_manifest,
)
from qrtest import ADMIN, demo_model_dir, serving
from quantroute.api.app import create_app
from quantroute.api.runner import Runner
from quantroute.registry import digests as digests_module
from quantroute.registry.manifest import sha256_file

pytestmark = pytest.mark.slow


def count_stops(engine: Any, stops: Counter[int]) -> None:
    """Count ``engine.stop()`` calls (the engine still stops)."""
    stop = engine.stop

    async def counted() -> None:
        stops[id(engine)] += 1
        await stop()

    engine.stop = counted


def hold_runs(monkeypatch: pytest.MonkeyPatch, gate: asyncio.Event) -> list[str]:
    """While ``gate`` is clear, routed jobs wait before they start: the branch ids held."""
    held: list[str] = []
    start = Runner.start

    async def delayed(self: Runner, job: Any) -> Any:
        if not gate.is_set():
            held.append(job.branches[0].id)
            await gate.wait()
        return await start(self, job)

    monkeypatch.setattr(Runner, "start", delayed)
    return held


async def wait_for(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_drain_does_not_block_the_next_reload_and_stops_each_worker_once(
    tmp_path: Path,
) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    settings = settings_for(repo, drain_quiet_s=6.0)  # every drain takes 6 s at least
    stops: Counter[int] = Counter()
    async with serving(create_app(settings)) as (client, gateway):
        reloader = gateway.reloader
        first = gateway.routes.current.models[MODEL].branches[0].engine
        count_stops(first, stops)
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        a = asyncio.create_task(reloader.reload("admin"))
        await wait_for(lambda: gateway.routes.current.version == 1)  # swapped, draining
        second = gateway.routes.current.models[MODEL].branches[0].engine
        count_stops(second, stops)
        assert reloader.status()["draining"] == [f"{MODEL}:main"]

        # the next reload runs while the first drains: an unchanged one, then a swap
        asked = time.monotonic()
        b = await reloader.reload("admin")
        assert b.outcome == "unchanged" and time.monotonic() - asked < 4.5, b
        replace_file(folder, (demo_model_dir() / "q4_k_m.gguf").read_bytes())
        write_manifest(folder, "q4_k_m")
        c = await reloader.reload("admin", wait=False)  # the watcher's way: at the swap
        assert c.outcome == "swapped" and c.generation == 2, c
        assert time.monotonic() - asked < 5.5
        assert not a.done()  # the first drain is still waiting
        assert await answering_artifact(client) == sha256_file(folder / "main.gguf")[:16]
        assert len(reloader.status()["draining"]) == 2

        report = await a
        assert report.outcome == "swapped" and report.drained == 1
        assert report.duration_s >= 6.0
        await wait_for(lambda: not reloader.status()["draining"], 15.0)
        # off the list first, then stopped, then recorded: the second drain's report comes
        await wait_for(lambda: reloader.last is not None and reloader.last.generation == 2, 15.0)
        assert reloader.counts["swapped"] == 2 and reloader.counts["unchanged"] == 1
        assert not first.ready and not second.ready
    assert stops[id(first)] == 1 and stops[id(second)] == 1  # not again at shutdown


async def test_shutdown_stops_the_workers_still_draining_once(tmp_path: Path) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    settings = settings_for(repo, drain_quiet_s=60.0)
    stops: Counter[int] = Counter()
    async with serving(create_app(settings)) as (_client, gateway):
        old = gateway.routes.current.models[MODEL].branches[0].engine
        count_stops(old, stops)
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        report = await gateway.reloader.reload("watch: main.gguf", wait=False)
        assert report.outcome == "swapped" and old.pid is not None
        pid = old.pid
        asked = time.monotonic()
    assert time.monotonic() - asked < 30.0  # shutdown did not wait out the drain
    assert stops[id(old)] == 1 and not old.ready and old.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # the drain finished with its report: counted once, after it stopped the worker
    assert gateway.reloader.last is not None and gateway.reloader.last.drained == 1


async def test_no_reload_swaps_once_the_gateway_stopped(tmp_path: Path) -> None:
    """A reload after (or waiting on the lock during) shutdown starts no worker that would
    outlive it: it fails, and the table stays the one shutdown stopped."""
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    async with serving(create_app(settings_for(repo))) as (_client, gateway):
        version = gateway.routes.current.version
    replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
    write_manifest(folder, "q8_0")
    report = await gateway.reloader.reload("watch: main.gguf")
    assert report.outcome == "failed" and "stopping" in report.failures["repository"]
    assert gateway.routes.current.version == version
    assert all(not b.engine.ready for b in gateway.routes.current.branches())


async def test_requests_routed_before_the_swap_that_start_after_it_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window between routing and ``engine.generate``: requests routed to the old
    worker are held there (a delay hook on the runner) until the reload has drained and
    stopped it; they must be answered (by the new worker), and no breaker counts it."""
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    gate = asyncio.Event()
    held = hold_runs(monkeypatch, gate)
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        gate.set()
        old_sha = await answering_artifact(client)
        old = gateway.routes.current.models[MODEL].branches[0].engine
        gate.clear()
        results: list[tuple[str, str, int, float]] = []
        steady_stop = asyncio.Event()

        async def steady() -> None:  # traffic that keeps running through the reload
            while not steady_stop.is_set():
                results.append(await stream_once(client, 16))

        waiting = [asyncio.create_task(stream_once(client, 8)) for _ in range(6)]
        await wait_for(lambda: len(held) == 6)  # routed to the old worker, not started
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        new_sha = sha256_file(folder / "main.gguf")[:16]
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["drained"] == 1, report
        assert not old.ready  # drained (nothing was in flight on it) and stopped
        gate.set()
        load = [asyncio.create_task(steady()) for _ in range(4)]
        late = await asyncio.gather(*waiting)
        await asyncio.sleep(0.5)
        steady_stop.set()
        await asyncio.gather(*load)
        assert all(a == new_sha and f == "length" and n > 0 for a, f, n, _ in late), late
        assert all(a == new_sha for a, *_ in results) and results
        assert gateway.breakers.get(f"{MODEL}:main").failures == 0
        assert old_sha != new_sha


async def test_a_retired_branch_without_successor_falls_back_without_counting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request pinned to a version the reload removed, held past the drain: the old
    worker is gone and the id has no successor, so it fails as a branch that is down
    before its first token (503, retryable), and no breaker counts it."""
    from api.test_api_reload import versioned_manifest

    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    shutil.copyfile(demo_model_dir() / "q8_0.gguf", folder / "v2.gguf")
    versioned_manifest(folder, [])
    gate = asyncio.Event()
    gate.set()
    held = hold_runs(monkeypatch, gate)
    body = {"model": f"{MODEL}@v2", "prompt": "def ", "max_tokens": 2}
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        gate.clear()
        pending = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_for(lambda: len(held) == 1)
        versioned_manifest(folder, [], other="v3")  # v2 goes
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["drained"] == 1, report
        gate.set()
        r = await pending
        assert r.status_code == 503, r.text
        assert "retry-after" in r.headers
        assert gateway.breakers.get(f"{MODEL}@v2:main").failures == 0


async def test_a_worker_stopped_for_a_replaced_file_is_not_reused_by_a_reload(
    tmp_path: Path,
) -> None:
    """The file is replaced by rename and the old worker dies (it is not restarted on an
    unchecked file); the operator puts the same bytes back: the fingerprint is the old
    one, but the reload must not hand back the stopped worker."""
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    original = (folder / "main.gguf").read_bytes()
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        (branch,) = gateway.routes.current.branches()
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        assert branch.engine.pid is not None
        os.kill(branch.engine.pid, signal.SIGKILL)
        await wait_for(lambda: f"{MODEL}:main" in gateway.superseded)
        await asyncio.sleep(1.0)
        assert not branch.engine.ready
        replace_file(folder, original)  # the same bytes (and sha256) under a new inode
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["swapped"] == [MODEL], report
        (now,) = gateway.routes.current.branches()
        assert now.engine is not branch.engine and now.engine.ready
        assert f"{MODEL}:main" not in gateway.superseded
        assert await answering_artifact(client) == sha256_file(folder / "main.gguf")[:16]


async def test_a_reload_hashes_each_file_once_and_skips_unchanged_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qrtest import ec_keys
    from quantroute.registry.signing import sign_model

    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    private, public = ec_keys(tmp_path, "operator")
    sign_model(folder, private_key=private)
    settings = settings_for(repo, require_signatures=True, public_key=public)
    hashed: Counter[str] = Counter()
    real = digests_module.sha256_file

    def counting(path: Path, *args: Any, **kwargs: Any) -> Any:
        hashed[Path(path).name] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(digests_module, "sha256_file", counting)
    from model_signing._hashing import io as signing_io

    own = signing_io.SimpleFileHasher.compute

    def signing_read(self: Any) -> Any:  # model-signing reading a file itself
        hashed[f"model-signing: {Path(self._file).name}"] += 1
        return own(self)

    monkeypatch.setattr(signing_io.SimpleFileHasher, "compute", signing_read)
    async with serving(create_app(settings)) as (client, _gateway):
        assert hashed["main.gguf"] == 1  # the start: the check and the signature share it
        assert not any(k.startswith("model-signing") for k in hashed), hashed
        # a file changed in the last RACY_S is hashed again (its timestamps are not trusted
        # yet); past that, once verified, it is not read again while it is unchanged
        changed = (folder / "main.gguf").stat().st_ctime
        await asyncio.sleep(max(0.0, changed + digests_module.RACY_S - time.time()) + 0.1)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "unchanged", report
        seen = hashed["main.gguf"]
        assert seen <= 2
        for _ in range(2):
            report = (await client.post("/admin/reload", headers=ADMIN)).json()
            assert report["outcome"] == "unchanged", report
        assert hashed["main.gguf"] == seen  # unchanged since it was verified: not re-read
        # rewritten in place with other bytes, same size: the sha256 check still sees it
        data = bytearray((folder / "main.gguf").read_bytes())
        data[-1] ^= 0xFF
        with (folder / "main.gguf").open("r+b") as fh:
            fh.write(bytes(data))
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed", report
        assert "signature does not verify" in report["failures"][MODEL]
        assert hashed["main.gguf"] == seen + 1
        assert not any(k.startswith("model-signing") for k in hashed), hashed

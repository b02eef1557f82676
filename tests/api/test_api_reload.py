"""Hot reload on real llama.cpp workers: a replaced file is validated, verified, started
and warmed up before it takes traffic; requests in flight finish on the old workers;
anything wrong leaves the old version serving, and says so."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from qrtest import ADMIN, ADMIN_KEY, demo_model_dir, ec_keys, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.registry.manifest import sha256_file

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def one_branch_repo(root: Path, source: str = "q4_k_m") -> Path:
    """A repository of the demo model with one branch, ``main``, holding ``source``'s file
    (one worker: the machine has two cores)."""
    folder = root / "repo" / MODEL
    folder.mkdir(parents=True)
    shutil.copyfile(demo_model_dir() / f"{source}.gguf", folder / "main.gguf")
    shutil.copyfile(demo_model_dir() / "profile.json", folder / "profile.json")
    write_manifest(folder, source)
    return root / "repo"


def write_manifest(folder: Path, precision: str, sha256: str | None = None) -> None:
    manifest = {
        "model": MODEL,
        "reference": "main",
        "branches": {
            "main": {
                "file": "main.gguf",
                "precision": precision,
                "sha256": sha256 or sha256_file(folder / "main.gguf"),
            }
        },
    }
    tmp = folder / "quantroute.yaml.tmp"
    tmp.write_text(yaml.safe_dump(manifest, sort_keys=False))
    tmp.replace(folder / "quantroute.yaml")


def replace_file(folder: Path, data: bytes) -> None:
    """The way to replace a model file while serving: write a temporary file, rename it."""
    tmp = folder / "main.gguf.tmp"
    tmp.write_bytes(data)
    tmp.replace(folder / "main.gguf")


def settings_for(repo: Path, **repository: Any) -> Any:
    return load_settings(
        repo=repo,
        telemetry={"devices": "cpu"},
        server={"admin_key": ADMIN_KEY},
        engine={"n_ctx": 256, "parallel": 4, "n_threads": 1},
        admission={"queue_size": 64},
        repository={"watch": False, "drain_quiet_s": 0.2} | repository,
    )


async def answering_artifact(client: httpx.AsyncClient) -> str:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "def ", "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    return r.headers["x-quantroute-artifact"]


async def stream_once(client: httpx.AsyncClient, max_tokens: int) -> tuple[str, str, int, float]:
    """One streamed completion: (artifact header, finish reason, tokens streamed, when it
    ended)."""
    body = {"model": MODEL, "prompt": "import ", "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        artifact = r.headers["x-quantroute-artifact"]
        finish, tokens, done = "", 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            tokens += 1 if choice.get("text") else 0
            finish = choice.get("finish_reason") or finish
    assert done, "stream truncated: no [DONE]"
    return artifact, finish, tokens, time.time()


async def test_reload_under_20_streams_loses_nothing_and_old_streams_finish_on_old(
    tmp_path: Path,
) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    old_sha = sha256_file(folder / "main.gguf")[:16]
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        assert await answering_artifact(client) == old_sha
        old_engine = gateway.routes.current.models[MODEL].branches[0].engine
        results: list[tuple[str, str, int, float]] = []
        stop = asyncio.Event()

        async def steady(i: int) -> None:
            while not stop.is_set():
                results.append(await stream_once(client, 24 + i % 5))

        load = [asyncio.create_task(steady(i)) for i in range(20)]
        await asyncio.sleep(1.0)
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        new_sha = sha256_file(folder / "main.gguf")[:16]
        asked = time.time()
        r = await client.post("/admin/reload", headers=ADMIN)
        assert r.status_code == 200
        report = r.json()
        assert report["outcome"] == "swapped", report
        assert report["swapped"] == [MODEL] and report["drained"] == 1
        swapped_at = asked + report["swap_s"]
        await asyncio.sleep(1.0)  # the new version under the same load
        stop.set()
        await asyncio.gather(*load)

    assert not old_engine.ready  # drained, then stopped
    assert {a for a, *_ in results} == {old_sha, new_sha}
    # streams that were running on the old version at the swap finished there, after it
    assert sum(1 for a, _, _, end in results if a == old_sha and end > swapped_at) >= 1
    # every stream ran to its own length on the version it started on (one artifact
    # header per stream, sent at its first token): none failed, none truncated
    assert all(f == "length" and n > 0 for _, f, n, _ in results), results
    assert sum(1 for a, *_ in results if a == new_sha) >= 20


async def test_corrupt_replacements_leave_the_old_version_serving(tmp_path: Path) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    old_sha = sha256_file(folder / "main.gguf")[:16]
    replacement = (demo_model_dir() / "q8_0.gguf").read_bytes()
    async with serving(create_app(settings_for(repo))) as (client, _gateway):
        # 1. a truncated GGUF, its sha256 declared: the header check refuses it
        replace_file(folder, replacement[: len(replacement) // 2])
        write_manifest(folder, "q8_0")
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed"
        assert "past the end of the file" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha

        # 2. a good file under a manifest declaring another sha256
        replace_file(folder, replacement)
        write_manifest(folder, "q8_0", sha256="0" * 64)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed" and "sha256" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha

        # 3. a manifest that no longer parses
        (folder / "quantroute.yaml").write_text("model: tiny-llama\nbranches: {}\n")
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed" and "quantroute.yaml" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha

        status = (await client.get("/admin/status", headers=ADMIN)).json()["repository"]
        assert status["reloads"]["failed"] == 3 and status["reloads"]["swapped"] == 0
        assert status["generation"] == 0
        assert MODEL in status["last_failure"]["failures"]

        # and once the files are right, it swaps
        replace_file(folder, replacement)
        write_manifest(folder, "q8_0")
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped", report
        assert await answering_artifact(client) == sha256_file(folder / "main.gguf")[:16]
        metrics = (await client.get("/metrics")).text
        assert 'quantroute_hot_reloads_total{outcome="rejected"} 3.0' in metrics
        assert 'quantroute_hot_reloads_total{outcome="applied"} 1.0' in metrics


async def test_a_replaced_file_makes_its_profile_stale_until_profiled_again(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "repo" / MODEL
    shutil.copytree(demo_model_dir(), folder)
    async with serving(create_app(settings_for(tmp_path / "repo"))) as (client, gateway):

        def branch(models: dict[str, Any], name: str) -> dict[str, Any]:
            entry = next(m for m in models["data"] if m["id"] == MODEL)
            return next(b for b in entry["branches"] if b["branch"] == name)

        before = (await client.get("/v1/models")).json()
        assert branch(before, "q8_0")["profile_state"] == "measured"
        # q8_0 replaced by another sound file (padding after the tensor data): a new
        # sha256, which the profile never measured
        data = (demo_model_dir() / "q8_0.gguf").read_bytes() + bytes(64)
        tmp = folder / "q8_0.gguf.tmp"
        tmp.write_bytes(data)
        tmp.replace(folder / "q8_0.gguf")
        manifest = yaml.safe_load((folder / "quantroute.yaml").read_text())
        manifest["branches"]["q8_0"]["sha256"] = sha256_file(folder / "q8_0.gguf")
        (folder / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["drained"] == 1, report
        after = (await client.get("/v1/models")).json()
        q8 = branch(after, "q8_0")
        assert q8["profile_state"] == "stale" and q8["profile"] is None
        assert branch(after, "q4_k_m")["profile_state"] == "measured"  # untouched, same worker
        entry = next(m for m in after["data"] if m["id"] == MODEL)
        assert any("changed since it was profiled" in w for w in entry["profile_warnings"])
        # routing does not trust the old numbers: the policy sees no KLD for it
        states = {st.name: st for st in gateway.states.read(MODEL)}
        assert states["q8_0"].mean_kld is None and states["q8_0"].top1 is None
        assert states["q4_k_m"].mean_kld is not None


async def test_admin_reload_is_closed_without_an_admin_key(tmp_path: Path) -> None:
    repo = one_branch_repo(tmp_path)
    open_settings = settings_for(repo).model_copy(
        update={"server": settings_for(repo).server.model_copy(update={"admin_key": None})}
    )
    async with serving(create_app(open_settings)) as (client, _gateway):
        r = await client.post("/admin/reload", json={})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert (await client.get("/admin/status")).status_code == 403
    async with serving(create_app(settings_for(repo))) as (client, _gateway):
        assert (await client.post("/admin/reload", json={})).status_code == 401
        bad = {"authorization": "Bearer nope"}
        assert (await client.post("/admin/reload", headers=bad)).status_code == 401
        r = await client.post("/admin/reload", headers=ADMIN)
        assert r.status_code == 200 and r.json()["outcome"] == "unchanged"


async def test_the_watcher_reloads_on_a_rename_and_ignores_temporary_files(
    tmp_path: Path,
) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    settings = settings_for(repo, watch=True, watch_debounce_ms=200)
    async with serving(create_app(settings)) as (client, gateway):
        await asyncio.sleep(0.5)  # the watcher is up
        (folder / "main.gguf.tmp").write_bytes(b"half a file")  # being written: ignored
        await asyncio.sleep(1.0)
        assert gateway.reloader.last is None
        replacement = (demo_model_dir() / "q8_0.gguf").read_bytes()
        (folder / "main.gguf.tmp").write_bytes(replacement)
        (folder / "main.gguf.tmp").replace(folder / "main.gguf")
        write_manifest(folder, "q8_0")
        new_sha = sha256_file(folder / "main.gguf")[:16]
        for _ in range(300):
            if gateway.reloader.last is not None and gateway.reloader.last.outcome == "swapped":
                break
            await asyncio.sleep(0.1)
        last = gateway.reloader.last
        assert last is not None and last.outcome == "swapped", last
        assert last.trigger.startswith("watch:") and ".tmp" not in last.trigger
        assert await answering_artifact(client) == new_sha


async def test_a_replacement_with_a_bad_signature_leaves_the_old_version_serving(
    tmp_path: Path,
) -> None:
    from quantroute.registry.signing import sign_model

    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    private, public = ec_keys(tmp_path, "operator")
    intruder, _ = ec_keys(tmp_path, "intruder")
    sign_model(folder, private_key=private)
    old_sha = sha256_file(folder / "main.gguf")[:16]
    settings = settings_for(repo, require_signatures=True, public_key=public)
    async with serving(create_app(settings)) as (client, _gateway):
        assert await answering_artifact(client) == old_sha
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        # not re-signed: the old signature no longer matches the files
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed"
        assert "signature does not verify" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha
        # signed, but by another key
        sign_model(folder, private_key=intruder)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed"
        assert "signature does not verify" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha
        # unsigned, while signatures are required
        (folder / "model.sig").unlink()
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert "requires signatures" in report["failures"][MODEL]
        assert await answering_artifact(client) == old_sha
        # signed by the operator: it swaps
        sign_model(folder, private_key=private)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped", report
        assert await answering_artifact(client) == sha256_file(folder / "main.gguf")[:16]


def versioned_manifest(folder: Path, traffic: list[dict[str, Any]], other: str = "v2") -> None:
    """v1 (the top level: main.gguf) and ``other`` (v2.gguf), with ``traffic``."""
    manifest: dict[str, Any] = {
        "model": MODEL,
        "reference": "main",
        "branches": {
            "main": {
                "file": "main.gguf",
                "precision": "q4_k_m",
                "sha256": sha256_file(folder / "main.gguf"),
            }
        },
        "versions": {},
        "traffic": traffic,
    }
    manifest["versions"][other] = {
        "branches": {
            "main": {
                "file": "v2.gguf",
                "precision": "q8_0",
                "sha256": sha256_file(folder / "v2.gguf"),
            }
        }
    }
    (folder / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


async def test_traffic_rules_change_without_restarts_and_rolling_back_stops_v2(
    tmp_path: Path,
) -> None:
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    shutil.copyfile(demo_model_dir() / "q8_0.gguf", folder / "v2.gguf")
    versioned_manifest(folder, [])
    body = {"model": MODEL, "prompt": "def ", "max_tokens": 2}
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        engines = {b.id: b.engine for b in gateway.routes.current.branches()}
        assert set(engines) == {f"{MODEL}@v1:main", f"{MODEL}@v2:main"}
        r = await client.post("/v1/completions", json=body | {"user": "anyone"})
        assert r.headers["x-quantroute-version"] == "v1"  # no rules: the default

        versioned_manifest(folder, [{"version": "v2", "header": "x-ab-group", "value": "b"}])
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["swapped"] == [], report
        assert report["changed"] == [MODEL]  # its traffic rules: no new worker
        assert report["drained"] == 0  # the same workers, new rules
        assert {b.id: b.engine for b in gateway.routes.current.branches()} == engines
        r = await client.post("/v1/completions", json=body, headers={"x-ab-group": "b"})
        assert r.headers["x-quantroute-version"] == "v2"
        r = await client.post("/v1/completions", json=body, headers={"x-ab-group": "a"})
        assert r.headers["x-quantroute-version"] == "v1"

        versioned_manifest(folder, [{"version": "v2", "percent": 100}])
        assert (await client.post("/admin/reload", headers=ADMIN)).json()["outcome"] == "swapped"
        r = await client.post("/v1/completions", json=body | {"user": "u1"})
        assert r.headers["x-quantroute-version"] == "v2"

        versioned_manifest(folder, [])  # roll back: the rule goes, v2 stays loaded
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["drained"] == 0, report
        r = await client.post("/v1/completions", json=body | {"user": "u1"})
        assert r.headers["x-quantroute-version"] == "v1"

        versioned_manifest(folder, [], other="v3")  # v2 retired (v3 takes its file)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped" and report["drained"] == 1, report
        assert not engines[f"{MODEL}@v2:main"].ready  # drained and stopped
        assert engines[f"{MODEL}@v1:main"].ready  # untouched
        r = await client.post("/v1/completions", json=body | {"model": f"{MODEL}@v2"})
        assert r.status_code == 404 and "its versions are v1, v3" in r.text
        r = await client.post("/v1/completions", json=body | {"model": f"{MODEL}@v3"})
        assert r.headers["x-quantroute-version"] == "v3"
        metrics = (await client.get("/metrics")).text
        for version, n in (("v1", 3), ("v2", 2), ("v3", 1)):
            line = f'quantroute_version_answers_total{{model="{MODEL}",version="{version}"}} {n}.0'
            assert line in metrics, version
        assert gateway.occupancy.get(f"{MODEL}@v2:main") is None  # its placement is gone


async def test_a_crashed_old_worker_is_not_restarted_on_an_unchecked_replacement(
    tmp_path: Path,
) -> None:
    import os
    import signal

    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        (branch,) = gateway.routes.current.branches()
        # replaced on disk, but the manifest still names the old sha256: the reload fails
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed" and "sha256" in report["failures"][MODEL]
        assert branch.engine.ready  # the old version serves on
        assert branch.engine.pid is not None
        os.kill(branch.engine.pid, signal.SIGKILL)
        for _ in range(50):
            if not branch.engine.ready:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # past the restart backoff
        assert not branch.engine.ready  # not restarted on the unchecked file
        models = (await client.get("/v1/models")).json()["data"]
        (state,) = next(m for m in models if m["id"] == MODEL)["branches"]
        assert state["state"] == "failed" and "replaced on disk" in state["failure"]
        # the operator finishes the replacement: the reload serves the new file
        write_manifest(folder, "q8_0")
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "swapped", report
        assert await answering_artifact(client) == sha256_file(folder / "main.gguf")[:16]
        models = (await client.get("/v1/models")).json()["data"]
        (state,) = next(m for m in models if m["id"] == MODEL)["branches"]
        assert state["state"] == "ready"

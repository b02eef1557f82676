"""Issue #32 H2a-H2c through the gateway, on real llama.cpp workers: a crash restart, an
operator's restart and a reload hand a worker only the verified bytes; a reload that
refuses new bytes does not keep a worker serving on bytes that changed under it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.test_api_reload import (
    MODEL,
    answering_artifact,
    one_branch_repo,
    replace_file,
    settings_for,
    write_manifest,
)
from hostile import rewrite_in_place
from qrtest import ADMIN, demo_model_dir, ec_keys, serving
from quantroute.api.app import create_app
from quantroute.api.reload import Reloader
from quantroute.registry import digests as digests_module
from quantroute.registry.manifest import sha256_file

pytestmark = pytest.mark.slow

BRANCH = f"{MODEL}:main"


async def branch_view(client: httpx.AsyncClient) -> dict[str, Any]:
    models = (await client.get("/v1/models")).json()["data"]
    (model,) = [m for m in models if m["id"] == MODEL]
    (branch,) = model["branches"]
    return dict(branch)


async def until_failed(client: httpx.AsyncClient, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        view = await branch_view(client)
        if view["state"] == "failed":
            return view
        assert time.monotonic() < deadline, f"never failed: {view}"
        await asyncio.sleep(0.1)


async def refused_completion(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503, (r.status_code, r.text)


def signed_repo(tmp_path: Path) -> tuple[Path, Any]:
    from quantroute.registry.signing import sign_model

    repo = one_branch_repo(tmp_path, "q4_k_m")
    private, public = ec_keys(tmp_path, "operator")
    sign_model(repo / MODEL, private_key=private)
    return repo, settings_for(repo, require_signatures=True, public_key=public)


async def test_a_crash_restart_never_serves_a_file_rewritten_in_place_with_its_old_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H2a, with signatures required: the worker is killed after the rewrite; the branch
    fails in words and answers nothing, rather than serving the new bytes under the old
    digest."""
    monkeypatch.setattr(digests_module, "RACY_S", 0.0)  # identity alone, as on a server
    repo, settings = signed_repo(tmp_path)
    folder = repo / MODEL
    async with serving(create_app(settings)) as (client, gateway):
        await answering_artifact(client)
        (branch,) = gateway.routes.current.branches()
        rewrite_in_place(folder / "main.gguf", (demo_model_dir() / "q8_0.gguf").read_bytes())
        assert branch.engine.pid is not None
        os.kill(branch.engine.pid, signal.SIGKILL)
        view = await until_failed(client)
        assert "main.gguf" in view["failure"] and str(tmp_path) not in view["failure"]
        await asyncio.sleep(1.0)  # past the restart backoff: still down
        assert not branch.engine.ready and branch.engine.pid is None
        await refused_completion(client)


async def test_the_admin_restart_answers_in_seconds_and_refuses_a_changed_file(
    tmp_path: Path,
) -> None:
    """H2b: a healthy branch restarts; after its file was replaced by another, unverified
    one (and its worker died), each restart answers within seconds and loads nothing."""
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    path = f"/admin/branches/{BRANCH}/restart"
    async with serving(create_app(settings_for(repo))) as (client, gateway):
        old_sha = await answering_artifact(client)
        r = await asyncio.wait_for(client.post(path, headers=ADMIN), 20.0)
        assert r.status_code == 200 and r.json()["ready"] is True, r.text
        assert await answering_artifact(client) == old_sha
        (branch,) = gateway.routes.current.branches()
        replace_file(folder, (demo_model_dir() / "f16.gguf").read_bytes())
        assert branch.engine.pid is not None
        os.kill(branch.engine.pid, signal.SIGKILL)
        await until_failed(client)
        for _ in range(2):
            started = time.monotonic()
            r = await asyncio.wait_for(client.post(path, headers=ADMIN), 10.0)
            assert time.monotonic() - started < 5.0
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["ready"] is False, answer
            assert "main.gguf changed on disk since it was verified" in answer["failure"]
            assert str(tmp_path) not in answer["failure"]
            assert branch.engine.pid is None
        await refused_completion(client)


async def test_a_file_renamed_in_between_a_reloads_check_and_its_start_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H2c: a legitimate new file (and manifest) is verified; before its worker starts, a
    different GGUF is renamed into place. The new worker refuses it, the reload fails in
    words, and the old worker (holding the old, verified inode) serves on."""
    repo = one_branch_repo(tmp_path, "q4_k_m")
    folder = repo / MODEL
    start = Reloader._start

    async def tampered_first(self: Reloader, *args: Any) -> Any:
        (folder / "evil.tmp").write_bytes((demo_model_dir() / "f16.gguf").read_bytes())
        (folder / "evil.tmp").replace(folder / "main.gguf")
        return await start(self, *args)

    async with serving(create_app(settings_for(repo))) as (client, gateway):
        old_sha = await answering_artifact(client)
        (old,) = gateway.routes.current.branches()
        replace_file(folder, (demo_model_dir() / "q8_0.gguf").read_bytes())
        write_manifest(folder, "q8_0")
        monkeypatch.setattr(Reloader, "_start", tampered_first)
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed", report
        assert "main.gguf changed on disk since it was verified" in report["failures"][MODEL]
        assert str(tmp_path) not in report["failures"][MODEL]
        (now,) = gateway.routes.current.branches()
        assert now.engine is old.engine and old.engine.ready
        assert await answering_artifact(client) == old_sha


async def test_a_reload_that_refuses_new_bytes_does_not_keep_a_worker_on_them(
    tmp_path: Path,
) -> None:
    """H2c's second half: the running branch's file is rewritten in place; the reload
    refuses the signature; the old version must not "serve on" the rewritten bytes: its
    branch fails, in words."""
    repo, settings = signed_repo(tmp_path)
    folder = repo / MODEL
    async with serving(create_app(settings)) as (client, _gateway):
        await answering_artifact(client)
        rewrite_in_place(folder / "main.gguf", (demo_model_dir() / "q8_0.gguf").read_bytes())
        report = (await client.post("/admin/reload", headers=ADMIN)).json()
        assert report["outcome"] == "failed"
        assert "signature does not verify" in report["failures"][MODEL]
        view = await until_failed(client)
        assert "main.gguf" in view["failure"], view
        await refused_completion(client)
        assert sha256_file(folder / "main.gguf") != view["sha256"]

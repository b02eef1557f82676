"""Issue #32 on real llama.cpp workers (the demo model): a worker loads the descriptor of
the verified file, not a path (a rename after the check cannot swap it); a restart after
a crash refuses a file rewritten in place with its old mtime (H2a); no secret of the
gateway's environment reaches a worker."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from qrtest import demo_model_dir
from quantroute.engines.environment import worker_env
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.registry import digests as digests_module
from quantroute.registry.manifest import check_artifacts, load_manifest
from quantroute.registry.verified import VerifiedFile

pytestmark = pytest.mark.slow


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), target)
    monkeypatch.setattr(digests_module, "RACY_S", 0.0)  # identity alone decides
    return target


def engine_for(model: Path, branch: str = "q4_k_m") -> LlamaCppEngine:
    (a,) = [a for a in check_artifacts(model, load_manifest(model)) if a.name == branch]
    return LlamaCppEngine(
        f"tiny-llama:{branch}",
        a.path,
        WorkerOptions(parallel=1, n_threads=1, n_ctx=128),
        RestartPolicy(backoff_s=0.05, backoff_max_s=0.1, max_crashes=3),
        verified=a.verified(),
    )


async def test_a_crash_restart_refuses_a_file_rewritten_in_place_with_its_old_mtime(
    model: Path, engines: list[LlamaCppEngine]
) -> None:
    """H2a: the rewrite keeps the inode and the mtime; the restarted worker must not load
    it: the branch fails, in words, and no worker runs."""
    engine = engine_for(model)
    engines.append(engine)
    await engine.start()
    assert engine.ready and engine.pid is not None
    path = model / "q4_k_m.gguf"
    st = path.stat()
    with path.open("r+b") as fh:
        fh.write((model / "q8_0.gguf").read_bytes())  # another sound GGUF, in place
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns
    os.kill(engine.pid, signal.SIGKILL)
    for _ in range(100):
        if engine.failure is not None:
            break
        await asyncio.sleep(0.05)
    assert engine.failure is not None, "restarted on the rewritten file"
    assert "q4_k_m.gguf changed on disk since it was verified" in engine.failure
    assert "a reload will verify the new one" in engine.failure
    assert str(model) not in engine.failure
    await asyncio.sleep(0.5)
    assert not engine.ready and engine.pid is None
    await asyncio.wait_for(engine.restart(), 10.0)  # an operator's restart checks again
    assert not engine.ready and engine.failure is not None


async def test_the_worker_loads_the_checked_descriptor_not_the_path(
    model: Path, engines: list[LlamaCppEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another file renamed over the path right after the check (H2c's timing, made
    deterministic): the worker still loads the verified bytes."""
    open_checked = VerifiedFile.open

    def then_swapped(self: VerifiedFile) -> tuple[int, VerifiedFile]:
        fd, now = open_checked(self)
        (model / "swap.tmp").write_bytes((model / "f16.gguf").read_bytes())
        (model / "swap.tmp").replace(self.path)
        return fd, now

    monkeypatch.setattr(VerifiedFile, "open", then_swapped)
    engine = engine_for(model)
    engines.append(engine)
    await engine.start()
    assert engine.ready and engine.info is not None and engine.pid is not None
    fds = f"/proc/{engine.pid}/fd"
    loaded = [os.readlink(f"{fds}/{n}") for n in os.listdir(fds)]
    assert str(model / "q4_k_m.gguf") + " (deleted)" in loaded, loaded  # the checked inode
    q4_bytes = (demo_model_dir() / "q4_k_m.gguf").stat().st_size
    assert engine.info.model_bytes < q4_bytes  # the q4_k_m weights, not f16's (3.8 MB)


def test_the_worker_environment_is_an_allowlist() -> None:
    env = worker_env(
        {
            "PATH": "/usr/bin",
            "HOME": "/root",
            "LC_ALL": "C.UTF-8",
            "CUDA_VISIBLE_DEVICES": "0",
            "QUANTROUTE_SERVER__ADMIN_KEY": "a",
            "QUANTROUTE_SERVER__METRICS_KEY": "m",
            "QUANTROUTE_ENGINE__N_CTX": "256",
            "AWS_SECRET_ACCESS_KEY": "s",
            "GGML_API_TOKEN": "t",
            "HF_TOKEN": "h",
        }
    )
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
    }


async def test_no_secret_of_the_gateway_reaches_a_worker(
    model: Path, engines: list[LlamaCppEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {
        "QUANTROUTE_SERVER__ADMIN_KEY": "qr-admin-secret-1",
        "QUANTROUTE_SERVER__METRICS_KEY": "qr-metrics-secret-2",
        "OPENAI_API_KEY": "sk-secret-3",
        "SOME_SERVICE_TOKEN": "secret-4",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    engine = engine_for(model)
    engines.append(engine)
    await engine.start()
    assert engine.ready and engine.pid is not None
    with open(f"/proc/{engine.pid}/environ", "rb") as fh:  # noqa: ASYNC230 (a /proc read)
        environ = fh.read()
    for name, value in secrets.items():
        assert name.encode() not in environ and value.encode() not in environ
    assert b"PATH=" in environ and b"CUDA_VISIBLE_DEVICES=" in environ

"""A bad model file fails its branch, never the server.

A repository of two models: one with a truncated and a corrupt-header GGUF
beside a good one, one with a missing file and a sha256 mismatch beside a good
one. The server starts, serves the good branches of both, and says what is
wrong with each bad one in /v1/models, /readyz and the log.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import yaml

from qrtest import demo_model_dir, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.registry.manifest import sha256_file

pytestmark = pytest.mark.slow


def _model(root: Path, name: str) -> Path:
    folder = root / name
    shutil.copytree(demo_model_dir(), folder)
    manifest = yaml.safe_load((folder / "quantroute.yaml").read_text())
    manifest["model"] = name
    (folder / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return folder


def _reseal(folder: Path, branch: str) -> None:
    """Declare the file's new sha256, so only the header check can catch it."""
    path = folder / "quantroute.yaml"
    manifest = yaml.safe_load(path.read_text())
    manifest["branches"][branch]["sha256"] = sha256_file(folder / f"{branch}.gguf")
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    a = _model(root, "model-a")
    data = (a / "q8_0.gguf").read_bytes()
    (a / "q8_0.gguf").write_bytes(data[: len(data) * 2 // 3])  # truncated
    _reseal(a, "q8_0")
    raw = bytearray((a / "q4_k_m.gguf").read_bytes())
    raw[16:24] = struct.pack("<Q", 1 << 40)  # n_kv: absurd
    (a / "q4_k_m.gguf").write_bytes(bytes(raw))
    _reseal(a, "q4_k_m")
    b = _model(root, "model-b")
    (b / "q8_0.gguf").unlink()  # missing
    with (b / "q4_k_m.gguf").open("ab") as fh:  # changed after the manifest was written
        fh.write(b"\0")
    return root


async def test_bad_files_fail_their_branches_and_the_good_ones_serve(
    repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(
        repo=repo,
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 512},
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as (client, _):
        ready = await client.get("/readyz")
        assert ready.status_code == 200, ready.json()  # each model has its good f16
        failed = ready.json()["failed_branches"]
        assert "past the end of the file" in failed["model-a"]["q8_0"]
        assert "metadata keys (absurd)" in failed["model-a"]["q4_k_m"]
        assert "is missing" in failed["model-b"]["q8_0"]
        assert "sha256" in failed["model-b"]["q4_k_m"]

        models = (await client.get("/v1/models")).json()["data"]
        states = {
            b["id"]: (b["state"], b["failure"])
            for m in models
            if "branches" in m
            for b in m["branches"]
        }
        assert states["model-a:f16"] == ("ready", None)
        assert states["model-b:f16"] == ("ready", None)
        assert states["model-a:q8_0"][0] == "failed"

        for model in ("model-a", "model-b"):
            r = await client.post(
                "/v1/completions", json={"model": model, "prompt": "def ", "max_tokens": 4}
            )
            assert r.status_code == 200 and r.headers["x-quantroute-branch"] == f"{model}:f16"
            pinned = await client.post(
                "/v1/completions", json={"model": f"{model}:q8_0", "prompt": "x", "max_tokens": 1}
            )
            assert pinned.status_code == 503
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "model-a:q8_0" in logged and "model-b:q4_k_m" in logged

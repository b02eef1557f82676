"""An ONNX Runtime branch whose weights lie in ``model.onnx.data`` (ONNX external data:
every real-size model's layout), end to end: declared with its ``data`` file, verified,
served by the gateway's worker through the verified descriptors, and profiled on the
same axis as the GGUF branches."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qrtest import ADMIN_KEY, demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.registry.manifest import sha256_file

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from quantroute.demo.onnx_export import export_onnx

pytestmark = pytest.mark.slow
BRANCH = "onnx_fp32x"


def _repo(root: Path) -> Path:
    """The demo's GGUF branches, and its f16 exported at fp32 with external data."""
    repo = demo_repo_copy(root, engine="llamacpp")
    model_dir = repo / "tiny-llama"
    folder = model_dir / BRANCH
    export_onnx(model_dir / "f16.gguf", folder, "fp32", external_data=True)
    manifest_path = model_dir / "quantroute.yaml"
    manifest = yaml.safe_load(manifest_path.read_text())
    manifest["branches"][BRANCH] = {
        "engine": "onnxruntime",
        "precision": "f32",
        "file": f"{BRANCH}/model.onnx",
        "sha256": sha256_file(folder / "model.onnx"),
        "tokenizer": {
            "file": f"{BRANCH}/tokenizer.gguf",
            "sha256": sha256_file(folder / "tokenizer.gguf"),
        },
        "data": {
            "file": f"{BRANCH}/model.onnx.data",
            "sha256": sha256_file(folder / "model.onnx.data"),
        },
    }
    manifest_path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return repo


async def test_a_graph_with_external_data_is_served_and_profiled(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=repo,
        engine={"parallel": 1, "n_threads": 1},
        routing={"speculation": "off"},
    )
    body = {"prompt": "def add(a, b):\n    return", "max_tokens": 16, "temperature": 0}
    async with serving(create_app(settings)) as (client, _):
        ready = (await client.get("/readyz")).json()
        assert BRANCH in ready["ready_branches"]["tiny-llama"]
        texts = {}
        for branch in (BRANCH, "f16"):
            r = await client.post("/v1/completions", json=body | {"model": f"tiny-llama:{branch}"})
            assert r.status_code == 200 and r.headers["x-quantroute-branch"].endswith(branch)
            texts[branch] = r.json()["choices"][0]["text"]
    assert texts[BRANCH] == texts["f16"]  # the f16 weights in float32: the same greedy text

    from quantroute.quality import profile_model

    result = profile_model(
        repo / "tiny-llama", n_ctx=128, max_chunks=2, n_threads=1, progress=False, plot=False
    )
    fp32x = next(p for p in result.branches if p.branch == BRANCH)
    assert 0 < fp32x.quality.mean_kld < 1e-5  # measured through the served path's model

"""``quantroute profile`` on a model with ONNX Runtime branches beside its GGUF ones.

The demo model's three GGUF branches and the three ONNX folders exported from its F16
GGUF (``onnx_fp16``, ``onnx_int8``, ``onnx_int4``) are profiled together, by the real
llama.cpp and the real ONNX Runtime (the serving worker's ``OnnxModel``), against the
GGUF F16 reference: one method, one ``profile.json``, one table and one plot.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import quantroute
from quantroute.config import default_settings
from quantroute.errors import EngineError
from quantroute.quality import BranchProfile, ProfileResult, format_table, load_profiles
from quantroute.quality.profiler import profile_model, profile_repo
from quantroute.quality.runners import LlamaRunner, OnnxRunner
from quantroute.registry.branch import TokenizerFile
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchSpec,
    load_manifest,
    sha256_file,
    verify_artifacts,
    write_manifest,
)
from quantroute.types import Precision

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("gguf")

DEMO = Path(quantroute.__file__).resolve().parent / "demo" / "repo" / "tiny-llama"
N_CTX = 128
CHUNKS = 8  # 8 x 63 = 504 scored tokens
FAST: dict[str, Any] = {"n_ctx": N_CTX, "max_chunks": CHUNKS, "n_threads": 1, "decode_tokens": 16}
ONNX = {"onnx_fp16": Precision.F16, "onnx_int8": Precision.INT8, "onnx_int4": Precision.INT4}
GGUF = ("f16", "q8_0", "q4_k_m")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DEMO / MANIFEST_NAME).is_file(), reason="demo model not built (quantroute demo build)"
    ),
]


def onnx_model(dst: Path) -> Path:
    """The demo model's GGUF branches and, beside them, the three ONNX folders exported
    from its F16 GGUF, each declared in the manifest (engine, file, sha256, tokenizer)."""
    from quantroute.demo.onnx_export import export_onnx_branches

    dst.mkdir(parents=True)
    manifest = load_manifest(DEMO)
    for name in [MANIFEST_NAME, *(manifest.branches[b].file for b in GGUF)]:
        shutil.copy2(DEMO / name, dst / name)
    folders = export_onnx_branches(dst / "f16.gguf", dst)
    branches = {b: manifest.branches[b] for b in GGUF}
    for name, precision in ONNX.items():
        folder = folders[name]
        branches[name] = BranchSpec(
            engine="onnxruntime",
            file=f"{name}/model.onnx",
            precision=precision,
            sha256=sha256_file(folder / "model.onnx"),
            tokenizer=TokenizerFile(
                file=f"{name}/tokenizer.gguf", sha256=sha256_file(folder / "tokenizer.gguf")
            ),
        )
    write_manifest(dst, manifest.model_copy(update={"branches": branches}))
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_model(tmp_path_factory.mktemp("onnx-profile") / "tiny-llama")


@pytest.fixture(scope="module")
def profiled(model_dir: Path) -> ProfileResult:
    return profile_repo(model_dir.parent, progress=False, plot=True, **FAST)


def by_branch(result: ProfileResult) -> dict[str, BranchProfile]:
    return {p.branch: p for p in result.models[0].branches}


def test_onnx_branches_are_measured_against_the_gguf_reference(profiled: ProfileResult) -> None:
    (model,) = profiled.models
    p = by_branch(profiled)
    assert next(iter(p)) == "f16" and set(p) == {*GGUF, *ONNX}  # reference first, all six
    assert model.method.n_scored_tokens == CHUNKS * (N_CTX - 1 - N_CTX // 2)
    assert model.method.onnxruntime_version is not None
    assert model.method.onnxruntime_version.startswith("onnxruntime ")
    fp16, int8, int4 = p["onnx_fp16"], p["onnx_int8"], p["onnx_int4"]
    # the same weights by another engine: as close as llama.cpp's f16 kernels allow
    # (measured 9.3e-8 here, top-1 1.0; the whole calibration text at n_ctx 512: 1.2e-6)
    assert 0.0 < fp16.mean_kld < 1e-6 and fp16.top1 >= 0.99
    assert abs(fp16.quality.ln_ppl_ratio) < 1e-3
    assert fp16.mean_kld < int8.mean_kld < int4.mean_kld
    assert int8.top1 > int4.top1
    # each ONNX quantization lands near the GGUF one of the same bits (docs/engines.md)
    assert int8.mean_kld < 10 * p["q8_0"].mean_kld and int4.mean_kld < 10 * p["q4_k_m"].mean_kld
    for b in p.values():
        assert b.quality.n_tokens == model.method.n_scored_tokens
        assert b.prefill_tps > 0 and b.decode_tps > 0 and b.rss_bytes > 0
    for name, precision in ONNX.items():
        assert p[name].precision is precision
        assert p[name].file_bytes == (model.model_dir / name / "model.onnx").stat().st_size
    assert p["onnx_fp16"].file_bytes > p["onnx_int8"].file_bytes > p["onnx_int4"].file_bytes


def test_profile_json_keys_onnx_branches_by_model_onnx(profiled: ProfileResult) -> None:
    model = profiled.models[0]
    raw = json.loads(model.profile_path.read_text())
    assert raw["method"]["onnxruntime_version"] == model.method.onnxruntime_version
    for name in ONNX:
        key = sha256_file(model.model_dir / name / "model.onnx")
        assert raw["branches"][key]["branch"] == name
    artifacts = verify_artifacts(model.model_dir, load_manifest(model.model_dir))
    assert set(raw["branches"]) == {a.sha256 for a in artifacts}
    loaded, warnings = load_profiles(model.model_dir, artifacts)
    assert warnings == []
    assert loaded == {p.branch: p for p in model.branches}


def test_a_served_route_gets_the_onnx_profiles(profiled: ProfileResult) -> None:
    """The catalog the server builds its routes with reads them for each ONNX branch."""
    from quantroute.api.catalog import Catalog

    model = profiled.models[0]
    settings = default_settings().model_copy(update={"repo": model.model_dir.parent})
    catalog = Catalog(settings)
    [build] = catalog.build_all(catalog.scan())
    [route] = build.routes
    assert route.profile_warnings == () and route.stale == frozenset()
    measured = by_branch(profiled)
    served = {b.name: b for b in route.branches}
    assert set(served) == set(measured)
    for name in ONNX:
        assert served[name].artifact.engine == "onnxruntime"
        assert served[name].profile == measured[name]


def test_table_and_plot_show_all_six_by_branch(profiled: ProfileResult) -> None:
    table = format_table(profiled)
    lines = table.splitlines()
    assert lines[0].startswith(f"tiny-llama: reference f16, n_ctx {N_CTX}, {CHUNKS} chunks")
    assert "llama-cpp-python" in lines[0] and ", onnxruntime " in lines[0]
    rows = {line.split()[0]: line for line in lines[3:]}
    assert set(rows) == {*GGUF, *ONNX}  # f16 and onnx_fp16, both precision f16, told apart
    assert rows["onnx_fp16"].split()[1] == rows["f16"].split()[1] == "f16"
    p = by_branch(profiled)
    for name in ONNX:
        assert f"{p[name].mean_kld:.6f}" in rows[name]
    pytest.importorskip("matplotlib")
    plot = profiled.models[0].plot_path
    assert plot is not None and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_onnx_reference_plans_with_its_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    """The reference may be the ONNX folder: its ``tokenizer.gguf`` plans the chunks, and
    the GGUF f16 is then the one measured against it."""
    dst = tmp_path / "tiny-llama"
    dst.mkdir()
    shutil.copy2(model_dir / "f16.gguf", dst / "f16.gguf")
    shutil.copytree(model_dir / "onnx_fp16", dst / "onnx_fp16")
    manifest = load_manifest(model_dir)
    branches = {b: manifest.branches[b] for b in ("onnx_fp16", "f16")}
    update = {"reference": "onnx_fp16", "branches": branches}
    write_manifest(dst, manifest.model_copy(update=update))
    result = profile_model(dst, progress=False, plot=False, **{**FAST, "max_chunks": 2})
    p = {b.branch: b for b in result.branches}
    assert list(p) == ["onnx_fp16", "f16"] and result.method.reference_branch == "onnx_fp16"
    assert p["onnx_fp16"].mean_kld == 0.0 and p["onnx_fp16"].top1 == 1.0
    assert 0.0 < p["f16"].mean_kld < 1e-6 and p["f16"].top1 >= 0.99


def test_the_onnx_runner_serves_the_gguf_reference_logits(model_dir: Path) -> None:
    """One chunk straight through both runners: the rows asked for, the same shape and
    nearly the same numbers; a prompt past its ``n_ctx`` is an ``EngineError``."""
    import numpy as np

    from quantroute.quality.profiler import default_calibration_text

    with LlamaRunner(model_dir / "onnx_fp16" / "tokenizer.gguf", vocab_only=True) as vocab:
        tokens = vocab.tokenize(default_calibration_text())[:32].tolist()
    with LlamaRunner(model_dir / "f16.gguf", n_ctx=32, n_threads=1) as llm:
        ref = llm.decode(tokens, pos0=0, rows=(16, 31))  # [15, V]
    folder = model_dir / "onnx_fp16"
    with OnnxRunner(folder / "model.onnx", folder / "tokenizer.gguf", n_ctx=32, n_threads=1) as r:
        got = r.decode(tokens, pos0=0, rows=(16, 31))  # [15, V]
        assert got.shape == ref.shape == (15, r.n_vocab) and got.dtype == np.float32
        assert float(np.abs(got - ref).max()) < 0.05
        # the same rows again after a clear; decoding on from the cache continues it
        r.clear()
        again = r.decode(tokens[:16], pos0=0, rows=(0, 16))
        step = r.decode(tokens[16:17], pos0=16, rows=(0, 1))  # [1, V]
        np.testing.assert_allclose(step[0], got[0], atol=1e-3)
        assert again.shape == (16, r.n_vocab)
        with pytest.raises(EngineError, match="no room"):
            r.decode(tokens, pos0=17, rows=(0, 1))

"""The demo's ONNX Runtime branches: ``add_onnx_branches`` exports a model folder's F16
GGUF and declares the folders in its manifest; the packaged demo holds exactly what it
writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from qrtest import demo_model_dir
from quantroute.demo.onnx_export import DEMO_ONNX_BRANCHES, add_onnx_branches
from quantroute.registry.manifest import MANIFEST_NAME, check_artifacts, load_manifest
from quantroute.types import Precision

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

GGUF_BRANCHES = ("f16", "q8_0", "q4_k_m")


def _gguf_only(dst: Path) -> Path:
    """A copy of the demo model folder with its GGUF branches alone."""
    src = demo_model_dir()
    dst.mkdir()
    for name in GGUF_BRANCHES:
        shutil.copyfile(src / f"{name}.gguf", dst / f"{name}.gguf")
    data = yaml.safe_load((src / MANIFEST_NAME).read_text())
    data["branches"] = {n: data["branches"][n] for n in GGUF_BRANCHES}
    (dst / MANIFEST_NAME).write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


def test_the_export_is_declared_beside_the_gguf_branches_and_checks(tmp_path: Path) -> None:
    model_dir = _gguf_only(tmp_path / "tiny-llama")
    written = add_onnx_branches(model_dir)
    assert written == load_manifest(model_dir)
    assert list(written.branches) == [*GGUF_BRANCHES, *DEMO_ONNX_BRANCHES]
    for name, precision in DEMO_ONNX_BRANCHES.items():
        spec = written.branches[name]
        assert (spec.engine, spec.precision, spec.file) == (
            "onnxruntime",
            precision,
            f"{name}/model.onnx",
        )
        assert spec.tokenizer is not None and spec.tokenizer.file == f"{name}/tokenizer.gguf"
    artifacts = check_artifacts(model_dir, written, isolated=True)
    assert [a.problem for a in artifacts] == [None] * 6  # every sha256 and header sound
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]  # no staging left


def test_exporting_again_replaces_the_folders_with_the_same_bytes(tmp_path: Path) -> None:
    model_dir = _gguf_only(tmp_path / "tiny-llama")
    first = add_onnx_branches(model_dir)
    (model_dir / "onnx_int4" / "model.onnx").write_bytes(b"damaged")
    again = add_onnx_branches(model_dir)
    assert again == first
    assert [a.problem for a in check_artifacts(model_dir, again)] == [None] * 6


def test_only_an_f16_or_f32_gguf_is_exported(tmp_path: Path) -> None:
    model_dir = _gguf_only(tmp_path / "tiny-llama")
    before = (model_dir / MANIFEST_NAME).read_bytes()
    with pytest.raises(ValueError, match="F16 or F32"):
        add_onnx_branches(model_dir, source="q4_k_m")
    assert (model_dir / MANIFEST_NAME).read_bytes() == before
    assert not (model_dir / "onnx_fp16").exists()


def test_the_packaged_demo_holds_what_the_export_writes(tmp_path: Path) -> None:
    """`quantroute demo build` exports the f16 file it wrote; the packaged folders are
    those bytes (the export is deterministic), so they serve the trained weights."""
    packaged = load_manifest(demo_model_dir())
    built = add_onnx_branches(_gguf_only(tmp_path / "tiny-llama"))
    for name, precision in DEMO_ONNX_BRANCHES.items():
        assert packaged.branches[name] == built.branches[name], name
        assert packaged.branches[name].precision is precision
    assert packaged.branches["onnx_fp16"].precision is Precision.F16

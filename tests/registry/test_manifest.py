from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from quantroute.config import DEMO_REPO
from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry import load_manifest, scan_repository, verify_artifacts
from quantroute.types import Precision

DEMO = DEMO_REPO / "tiny-llama"


def test_packaged_demo_manifest_verifies() -> None:
    manifest = load_manifest(DEMO)
    assert manifest.model == "tiny-llama"
    engines = {name: spec.engine for name, spec in manifest.branches.items()}
    assert engines == {
        "f16": "llamacpp",
        "q8_0": "llamacpp",
        "q4_k_m": "llamacpp",
        "onnx_fp16": "onnxruntime",
        "onnx_int8": "onnxruntime",
        "onnx_int4": "onnxruntime",
    }
    artifacts = verify_artifacts(DEMO, manifest)
    assert {a.name: a.engine for a in artifacts} == engines
    reference = next(a for a in artifacts if a.is_reference)
    assert reference.name == "f16" and reference.precision is Precision.F16
    precisions = {a.name: a.precision for a in artifacts if a.engine == "onnxruntime"}
    assert precisions == {
        "onnx_fp16": Precision.F16,
        "onnx_int8": Precision.INT8,
        "onnx_int4": Precision.INT4,
    }
    for a in artifacts:  # an ONNX branch is a folder: its graph and its tokenizer, both checked
        onnx = a.engine == "onnxruntime"
        assert a.path.name == ("model.onnx" if onnx else f"{a.name}.gguf")
        assert (a.tokenizer is not None) is onnx
    # the package ships the demo: its GGUF files stay small, the whole folder too
    assert sum(a.size_bytes for a in artifacts if a.engine == "llamacpp") <= 8 * 1024 * 1024
    assert sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file()) <= 16 * 1024 * 1024


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(DEMO, target)
    return target


def test_tampered_file_is_refused(model_copy: Path) -> None:
    with (model_copy / "q8_0.gguf").open("r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ArtifactIntegrityError, match="q8_0"):
        verify_artifacts(model_copy, load_manifest(model_copy))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("reference: f16", "reference: f32"), "reference"),
        (lambda t: t.replace("precision: q8_0", "precision: q9"), "precision"),
        (lambda t: t.replace("file: f16.gguf", "file: ../../etc/passwd"), "file"),
        (lambda t: t + "surprise: 1\n", "surprise"),
        (lambda t: "model: [unclosed\n", "YAML"),
    ],
)
def test_bad_manifests_are_clear_errors(model_copy: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    path = model_copy / "quantroute.yaml"
    path.write_text(edit(path.read_text()))
    with pytest.raises(ManifestError, match=message):
        load_manifest(model_copy)


def test_a_bad_model_is_left_out_and_the_others_still_load(model_copy: Path) -> None:
    broken = model_copy.parent / "broken"
    broken.mkdir()
    (broken / "quantroute.yaml").write_text("model: broken\n")
    scan = scan_repository(model_copy.parent)
    assert [m.manifest.model for m in scan.models] == ["tiny-llama"]
    assert len(scan.problems) == 1 and "reference: Field required" in scan.problems[0]

"""An ONNX branch whose weights lie beside its graph (``model.onnx.data``, ONNX external
data): the manifest declares the file (``data: {file, sha256}``), the scan verifies all
three files by sha256, and the graph check admits external tensors only where each
names exactly the declared file, inside its bytes; everything else fails the branch in
words. The demo's export declares the file it wrote."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from qrtest import demo_model_dir, demo_repo_copy
from quantroute.engines.table import ENGINES
from quantroute.errors import ManifestError
from quantroute.registry.manifest import BranchArtifact, load_manifest, sha256_file
from quantroute.registry.onnx_check import DataFile
from quantroute.registry.onnx_pair import read_onnx_isolated
from quantroute.registry.repository import scan_model
from quantroute.types import Precision

onnx = pytest.importorskip("onnx")
pytest.importorskip("gguf")

NAME = "onnx_fp32"
DATA = "model.onnx.data"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's F16 GGUF as an fp32 ONNX folder, its weights in model.onnx.data."""
    from quantroute.demo.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / NAME
    export_onnx(demo_model_dir() / "f16.gguf", out, "fp32", external_data=True)
    assert (out / DATA).stat().st_size > 10 * (out / "model.onnx").stat().st_size
    return out


def _branch(model_dir: Path, data: bool = True) -> dict[str, Any]:
    folder = model_dir / NAME
    entry: dict[str, Any] = {
        "engine": "onnxruntime",
        "file": f"{NAME}/model.onnx",
        "precision": "f32",
        "sha256": sha256_file(folder / "model.onnx"),
        "tokenizer": {
            "file": f"{NAME}/tokenizer.gguf",
            "sha256": sha256_file(folder / "tokenizer.gguf"),
        },
    }
    if data:
        entry["data"] = {"file": f"{NAME}/{DATA}", "sha256": sha256_file(folder / DATA)}
    return entry


def _edit(repo: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = repo / "tiny-llama" / "quantroute.yaml"
    manifest = yaml.safe_load(path.read_text())
    change(manifest["branches"])
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))


@pytest.fixture
def repo(tmp_path: Path, exported: Path) -> Path:
    """The demo's GGUF branches and the external-data folder as ``onnx_fp32``."""
    repo = demo_repo_copy(tmp_path, engine="llamacpp")
    model_dir = repo / "tiny-llama"
    shutil.copytree(exported, model_dir / NAME)
    _edit(repo, lambda b: b.update({NAME: _branch(model_dir)}))
    return repo


def _scan(repo: Path, **how: Any) -> dict[str, BranchArtifact]:
    entry = scan_model(repo / "tiny-llama", engines=ENGINES, **how)
    return {a.name: a for a in entry.artifacts}


@pytest.mark.parametrize("isolated", [True, False])
def test_a_branch_with_external_data_verifies_its_three_files(repo: Path, isolated: bool) -> None:
    artifacts = _scan(repo, isolated=isolated)
    a = artifacts[NAME]
    assert a.problem is None and a.precision is Precision.F32
    model, tokenizer, data = a.verified(), a.verified_tokenizer(), a.verified_data()
    assert model is not None and tokenizer is not None and data is not None
    folder = repo / "tiny-llama" / NAME
    assert data.label == f"{NAME}/{DATA}" and data.path == folder / DATA == a.data_path
    assert data.sha256 == sha256_file(folder / DATA)
    assert a.data_file() == DataFile(DATA, (folder / DATA).stat().st_size)
    assert artifacts["f16"].verified_data() is None and artifacts["f16"].data_file() is None
    if isolated:  # what the memory model reads counts the weights in the data file
        summary = read_onnx_isolated(a.path)
        graph, weights = (folder / "model.onnx").stat().st_size, (folder / DATA).stat().st_size
        assert weights < summary.weights_bytes < weights + graph  # small ones stay inline
        assert (summary.n_layer, summary.n_vocab, summary.n_ctx_train) == (2, 354, 512)
    # a data file renamed over since is noticed before any worker loads it
    assert not a.replaced()
    swapped = folder / "swapped"
    swapped.write_bytes((folder / DATA).read_bytes())
    os.replace(swapped, folder / DATA)
    assert a.replaced()


def test_a_data_file_that_does_not_match_its_sha256_fails_the_branch(repo: Path) -> None:
    path = repo / "tiny-llama" / NAME / DATA
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    artifacts = _scan(repo, isolated=True)
    a = artifacts[NAME]
    assert a.problem == (
        f"tiny-llama:{NAME}: data {NAME}/{DATA} does not match the manifest's data.sha256"
    )
    assert a.verified() is None and a.verified_data() is None
    assert artifacts["f16"].problem is None


def test_a_missing_data_file_fails_the_branch(repo: Path) -> None:
    (repo / "tiny-llama" / NAME / DATA).unlink()
    a = _scan(repo)[NAME]
    assert a.problem == f"tiny-llama:{NAME}: data {NAME}/{DATA} is missing"


def _retarget(tensor_change: Callable[[Any, int], None]) -> Callable[[Path], None]:
    """A rewrite of the graph's first external tensor's entries (``(tensor, data size)``)."""

    def rewrite(folder: Path) -> None:
        model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        tensor = next(
            t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
        )
        tensor_change(tensor, (folder / DATA).stat().st_size)
        (folder / "model.onnx").write_bytes(model.SerializeToString())

    return rewrite


def _set(key: str, value: Callable[[int], str]) -> Callable[[Any, int], None]:
    def change(tensor: Any, size: int) -> None:
        for entry in tensor.external_data:
            if entry.key == key:
                entry.value = value(size)
                return
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value(size)

    return change


def _inline_all(folder: Path) -> None:
    model = onnx.load(str(folder / "model.onnx"))  # the weights read back in
    (folder / "model.onnx").write_bytes(model.SerializeToString())


@pytest.mark.parametrize(
    ("hostile", "problem"),
    [
        (_retarget(_set("location", lambda _: "other.data")), "keeps its data in 'other.data'"),
        (_retarget(_set("location", lambda _: f"../{NAME}/{DATA}")), "not in the declared"),
        (_retarget(_set("location", lambda _: "/etc/passwd")), "not in the declared data file"),
        (_retarget(_set("location", lambda _: "*/_ORT_MEM_ADDR_/*")), "not in the declared"),
        (_retarget(_set("offset", str)), "lies past the end of the data file"),
        (_retarget(_set("offset", lambda _: "-1")), "offset is not a number"),
        (_retarget(_set("length", lambda _: "4")), "its dimensions say"),
        (_retarget(_set("basepath", lambda _: "/")), "a key 'basepath' ONNX does not define"),
        (_inline_all, "keeps no tensor in another file"),
    ],
)
def test_a_graph_that_points_elsewhere_fails_its_branch_in_words(
    repo: Path, hostile: Callable[[Path], None], problem: str
) -> None:
    model_dir = repo / "tiny-llama"
    hostile(model_dir / NAME)
    _edit(repo, lambda b: b.update({NAME: _branch(model_dir)}))
    for isolated in (True, False):
        a = _scan(repo, isolated=isolated)[NAME]
        assert a.problem is not None, problem
        assert a.problem.startswith(f"tiny-llama:{NAME}: {NAME}/model.onnx: ")
        assert problem in a.problem
        assert a.verified() is None and a.verified_data() is None


def test_external_data_without_a_declared_data_file_is_refused(repo: Path) -> None:
    model_dir = repo / "tiny-llama"
    _edit(repo, lambda b: b.update({NAME: _branch(model_dir, data=False)}))
    a = _scan(repo, isolated=True)[NAME]
    assert a.problem is not None
    assert "keeps its data in another file (external data), and the branch declares no" in (
        a.problem
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda e: e["data"].update(file="elsewhere/model.onnx.data"), "must lie beside its graph"),
        (lambda e: e["data"].update(file="../model.onnx.data"), "a path inside the model folder"),
        (lambda e: e["data"].update(sha256="XYZ"), "64 lowercase hex digits"),
        (lambda e: e["data"].update(file=e["file"]), "another file than the graph's"),
        (lambda e: e.pop("tokenizer"), "needs a tokenizer"),
    ],
)
def test_a_wrong_data_entry_is_a_manifest_error(
    repo: Path, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    model_dir = repo / "tiny-llama"

    def edit(branches: dict[str, Any]) -> None:
        entry = _branch(model_dir)
        change(entry)
        branches[NAME] = entry

    _edit(repo, edit)
    with pytest.raises(ManifestError, match=words):
        load_manifest(model_dir, ENGINES)


def test_a_gguf_branch_takes_no_data_file(repo: Path) -> None:
    model_dir = repo / "tiny-llama"
    _edit(repo, lambda b: b["q8_0"].update(data={"file": "q8_0.data", "sha256": "0" * 64}))
    with pytest.raises(ManifestError, match=r"data \(external weights\) is for an ONNX branch"):
        load_manifest(model_dir, ENGINES)


def test_the_demo_export_declares_the_data_file_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantroute.demo import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)  # every export past it
    repo = demo_repo_copy(tmp_path, engine="llamacpp")
    model_dir = repo / "tiny-llama"
    manifest = onnx_export.add_onnx_branches(model_dir, branches={NAME: Precision.F32})
    spec = manifest.branches[NAME]
    assert spec.data is not None and spec.data.file == f"{NAME}/{DATA}"
    assert spec.data.sha256 == sha256_file(model_dir / NAME / DATA)
    a = _scan(repo, isolated=True)[NAME]
    assert a.problem is None and a.verified_data() is not None

"""The manifest schema: versions, traffic rules, remote branches, device hints and engine
options parse; every mistake is an error naming the file, the field and the problem."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from qrtest import demo_model_dir
from quantroute.errors import ManifestError
from quantroute.registry import load_manifest, scan_repository, write_manifest
from quantroute.registry.manifest import check_versions

SHA = "a" * 64


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), target)
    return target


def _edit(model: Path, change: Any) -> dict[str, Any]:
    path = model / "quantroute.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def _versioned(data: dict[str, Any]) -> None:
    data["versions"] = {
        "v2": {"branches": {"f16": dict(data["branches"]["f16"])}, "reference": "f16"}
    }
    data["traffic"] = [
        {"version": "v2", "header": "x-ab-group", "value": "b"},
        {"version": "v2", "percent": 10},
    ]


def test_versions_traffic_remote_device_and_options_parse(model: Path) -> None:
    def change(data: dict[str, Any]) -> None:
        _versioned(data)
        data["branches"]["q8_0"]["device"] = "cuda:0"
        data["branches"]["q8_0"]["options"] = {"n_ctx": 512, "parallel": 2}
        data["branches"]["fp8"] = {
            "url": "http://10.0.0.7:8000/v1",
            "precision": "f16",
            "engine": "openai",
            "remote_model": "llama-3-8b-fp8",
            "api_key_env": "GPU_A_KEY",
            "remote": {"max_connections": 8, "server": "vllm"},
        }

    _edit(model, change)
    manifest = load_manifest(model)
    assert manifest.version_names() == ["v1", "v2"]
    assert manifest.traffic[1].percent == 10
    assert manifest.branches["q8_0"].options.n_ctx == 512
    assert manifest.branches["fp8"].url == "http://10.0.0.7:8000/v1"
    v1, v2 = check_versions(model, manifest)
    assert [a.route for a in v2] == ["tiny-llama@v2"]
    remote = next(a for a in v1 if a.name == "fp8")
    assert remote.problem is None and remote.device == "remote:10.0.0.7:8000"
    assert remote.spec is not None and remote.spec.remote.max_connections == 8
    assert remote.spec.remote_model == "llama-3-8b-fp8" and remote.verified() is None
    assert all(a.problem is None for a in v1)
    # the file written back reads the same
    write_manifest(model, manifest)
    assert load_manifest(model) == manifest


def test_the_packaged_manifest_round_trips_unchanged(tmp_path: Path) -> None:
    manifest = load_manifest(demo_model_dir())
    write_manifest(tmp_path, manifest)
    assert (tmp_path / "quantroute.yaml").read_text() == (
        demo_model_dir() / "quantroute.yaml"
    ).read_text()


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        (lambda d: d["branches"]["f16"].pop("sha256"), "branches.f16", "needs its sha256"),
        (
            lambda d: d["branches"]["f16"].update(url="http://x"),
            "branches.f16",
            "exactly one of file",
        ),
        (
            lambda d: d["branches"]["f16"].update(file="", url="ftp://x", engine="openai"),
            "branches.f16.url",
            "http:// or https://",
        ),
        (
            lambda d: d["branches"]["f16"].update(device="tpu:0"),
            "branches.f16.device",
            "cpu, cuda:N or sim:N",
        ),
        (
            lambda d: d["branches"]["f16"].update(options={"n_ctx": 1}),
            "branches.f16.options.n_ctx",
            "greater than or equal to 16",
        ),
        (
            lambda d: d["branches"]["f16"].update(options={"rope": 2}),
            "branches.f16.options.rope",
            "Extra inputs",
        ),
        (lambda d: d.update(traffic=[{"version": "v2", "percent": 5}]), "", "need versions"),
        (
            lambda d: (_versioned(d), d["traffic"].append({"version": "v3", "percent": 5})),
            "",
            "traffic.2.version: 'v3' is not a version",
        ),
        (
            lambda d: (_versioned(d), d["traffic"].append({"version": "v2", "percent": 95})),
            "",
            "add up to 105",
        ),
        (
            lambda d: (_versioned(d), d["traffic"].append({"version": "v2", "header": "x"})),
            "",
            "needs both header and value",
        ),
        (
            lambda d: (_versioned(d), d["versions"]["v2"].update(reference="q8_0")),
            "",
            "versions.v2.branches: reference branch 'q8_0'",
        ),
        (
            lambda d: (_versioned(d), d.update(default_version="v9")),
            "",
            "default_version 'v9' is not a version",
        ),
    ],
)
def test_mistakes_name_the_file_the_field_and_the_problem(
    model: Path, change: Any, field: str, problem: str
) -> None:
    _edit(model, change)
    with pytest.raises(ManifestError) as caught:
        load_manifest(model)
    message = caught.value.message
    assert message.startswith("tiny-llama/quantroute.yaml: ")  # relative: it is shown
    assert field in message and problem in message, message


def test_a_manifest_that_is_not_a_mapping_is_a_clear_error(model: Path) -> None:
    (model / "quantroute.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ManifestError, match="must be a mapping"):
        load_manifest(model)


def test_a_versioned_model_scans_every_version(model: Path) -> None:
    _edit(model, _versioned)
    (entry,) = scan_repository(model.parent).models
    assert [len(v) for v in entry.versions] == [6, 1]
    assert entry.versions[1][0].version == "v2" and entry.versions[0][0].version == "v1"
    engines = sorted(a.engine for a in entry.versions[0])  # v1: the whole demo, both engines
    assert engines == ["llamacpp"] * 3 + ["onnxruntime"] * 3
    assert all(a.problem is None for v in entry.versions for a in v)


@pytest.mark.parametrize(
    ("name", "temporary"),
    [
        ("q8_0.gguf", False),
        ("quantroute.yaml", False),
        ("profile.json", False),
        ("q8_0.gguf.tmp", True),
        ("q8_0.gguf.part", True),
        (".q8_0.gguf.swp", True),
        ("quantroute.yaml~", True),
        (".model.sig.tmp", True),
    ],
)
def test_the_watcher_ignores_temporary_files(name: str, temporary: bool) -> None:
    from quantroute.registry import is_temporary

    assert is_temporary(Path("/repo/m") / name) is temporary

"""The engine table (``engines/table.py``): a manifest's ``engine:`` names an entry, the
entry says what it takes, and a new engine is one entry — shown here by adding a fake
engine through the table and serving a branch with it, with no other change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from qrtest import demo_repo_copy
from quantroute.api.catalog import Catalog
from quantroute.config import default_settings
from quantroute.engines.base import Engine, GenerationRequest, SamplingParams, TokenEvent
from quantroute.engines.fake import FakeEngine
from quantroute.engines.llamacpp.engine import LlamaCppEngine
from quantroute.engines.openai.engine import OpenAIEngine
from quantroute.engines.table import ENGINES, BuildContext, EngineKind
from quantroute.errors import ManifestError
from quantroute.registry.manifest import BranchArtifact, load_manifest
from quantroute.types import Precision


def _edit(repo: Path, change: Any) -> None:
    path = repo / "tiny-llama" / "quantroute.yaml"
    data = yaml.safe_load(path.read_text())
    change(data["branches"])
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_the_table_names_each_engine_once_with_what_it_takes() -> None:
    assert set(ENGINES) == {"llamacpp", "onnxruntime", "openai"}
    assert all(name == kind.name for name, kind in ENGINES.items())
    llamacpp, onnx, openai = ENGINES["llamacpp"], ENGINES["onnxruntime"], ENGINES["openai"]
    assert (llamacpp.source, llamacpp.prompt, llamacpp.scores) == ("file", "rendered", "logits")
    assert (onnx.source, onnx.prompt, onnx.scores) == ("file", "rendered", "logits")
    assert (openai.source, openai.prompt, openai.scores) == ("url", "messages", "top_logprobs")
    assert (llamacpp.tokenizer, onnx.tokenizer, openai.tokenizer) == (False, True, False)
    assert Precision.Q4_K_M in llamacpp.precisions and Precision.FP8 not in llamacpp.precisions
    assert Precision.INT8 not in llamacpp.precisions and Precision.INT4 not in llamacpp.precisions
    assert onnx.precisions == {Precision.F32, Precision.F16, Precision.INT8, Precision.INT4}
    assert Precision.FP8 in openai.precisions and Precision.AWQ in openai.precisions
    assert Precision.INT8 in openai.precisions  # a remote serves what it serves


@pytest.mark.parametrize(
    ("branch", "problem"),
    [
        ({"engine": "vllm", "url": "http://h:1/v1", "precision": "fp8"}, "unknown engine"),
        (
            {"engine": "llamacpp", "url": "http://h:1/v1", "precision": "f16"},
            "engine llamacpp runs a file, not a url",
        ),
        (
            {"engine": "openai", "file": "f16.gguf", "sha256": "0" * 64, "precision": "f16"},
            "engine openai runs a url, not a file",
        ),
        (
            {"file": "f16.gguf", "sha256": "0" * 64, "precision": "fp8"},
            "engine llamacpp does not run precision fp8",
        ),
        (
            {"file": "f16.gguf", "sha256": "0" * 64, "precision": "f16", "remote_model": "x"},
            "are for url branches",
        ),
        (
            {"engine": "openai", "url": "http://h:1/v1", "precision": "f16", "api_key_env": "a b"},
            "api_key_env must name an environment variable",
        ),
        (
            {"engine": "onnxruntime", "file": "m.onnx", "sha256": "0" * 64, "precision": "int8"},
            "engine onnxruntime needs a tokenizer",
        ),
        (
            {
                "engine": "onnxruntime",
                "file": "m.onnx",
                "sha256": "0" * 64,
                "precision": "q4_k_m",
                "tokenizer": {"file": "t.gguf", "sha256": "0" * 64},
            },
            "engine onnxruntime does not run precision q4_k_m",
        ),
        (
            {"engine": "onnxruntime", "url": "http://h:1/v1", "precision": "int8"},
            "engine onnxruntime runs a file, not a url",
        ),
    ],
)
def test_an_unsupported_combination_is_a_manifest_error_naming_file_and_branch(
    tmp_path: Path, branch: dict[str, Any], problem: str
) -> None:
    repo = demo_repo_copy(tmp_path)
    _edit(repo, lambda branches: branches.update(bad=branch))
    with pytest.raises(ManifestError) as caught:
        load_manifest(repo / "tiny-llama", ENGINES)
    assert caught.value.message.startswith("tiny-llama/quantroute.yaml: branches.bad")
    assert problem in caught.value.message


def test_each_entry_builds_its_engine(tmp_path: Path) -> None:
    repo = demo_repo_copy(tmp_path)
    _edit(
        repo,
        lambda b: b.update(
            fp8={
                "engine": "openai",
                "url": "http://127.0.0.1:9/v1",
                "precision": "fp8",
                "remote_model": "served-name",
                "api_key_env": "QR_TEST_GPU_KEY",
            }
        ),
    )
    settings = default_settings().model_copy(update={"repo": repo})
    catalog = Catalog(settings)
    scan = catalog.scan()
    [build] = catalog.build_all(scan)
    engines = {b.name: b.engine for b in build.routes[0].branches}
    assert isinstance(engines["f16"], LlamaCppEngine)
    remote = engines["fp8"]
    assert isinstance(remote, OpenAIEngine)
    assert remote.url == "http://127.0.0.1:9/v1" and remote.model_path is None
    assert "QR_TEST_GPU_KEY" not in repr(remote.__dict__.get("_config", ""))


def test_an_onnx_branch_builds_the_worker_with_its_two_verified_files(tmp_path: Path) -> None:
    from quantroute.engines.llamacpp.options import WorkerOptions

    if "backend" not in WorkerOptions.__dataclass_fields__:
        pytest.skip("the ONNX worker (WorkerOptions.backend) is not in yet")
    pytest.importorskip("onnx")
    from quantroute.demo.onnx_export import export_onnx
    from quantroute.registry.manifest import sha256_file

    repo = demo_repo_copy(tmp_path)
    folder = repo / "tiny-llama" / "onnx_int4"
    export_onnx(repo / "tiny-llama" / "f16.gguf", folder, "int4")
    branch = {
        "engine": "onnxruntime",
        "file": "onnx_int4/model.onnx",
        "precision": "int4",
        "sha256": sha256_file(folder / "model.onnx"),
        "tokenizer": {
            "file": "onnx_int4/tokenizer.gguf",
            "sha256": sha256_file(folder / "tokenizer.gguf"),
        },
        "options": {"n_ctx": 256, "parallel": 2},
    }
    _edit(repo, lambda b: b.update(onnx_int4=branch))
    settings = default_settings().model_copy(update={"repo": repo})
    catalog = Catalog(settings)
    [build] = catalog.build_all(catalog.scan())
    engines = {b.name: b.engine for b in build.routes[0].branches}
    engine = engines["onnx_int4"]
    assert isinstance(engine, LlamaCppEngine) and isinstance(engines["f16"], LlamaCppEngine)
    assert engine.model_path == folder / "model.onnx"
    argv = " ".join(engine._files.argv(engine._options))
    assert engine._options.backend == "onnx"
    assert (engine._options.n_ctx, engine._options.parallel) == (256, 2)
    assert str(folder / "tokenizer.gguf") in argv and engine._files.verified
    # a branch whose tokenizer fails its check still gets its (never started) engine
    (folder / "tokenizer.gguf").write_bytes(b"GGUF")
    [build] = catalog.build_all(catalog.scan())
    failed = next(b for b in build.routes[0].branches if b.name == "onnx_int4")
    assert failed.artifact.problem is not None and "tokenizer.sha256" in failed.artifact.problem
    assert isinstance(failed.engine, LlamaCppEngine) and not failed.engine._files.verified


class _Echo(FakeEngine):
    """A fake engine that says which request it got, for the table test."""

    def __init__(self, name: str, url: str):
        super().__init__(f"served by {url}", name=name)


def _fake(ctx: BuildContext, a: BranchArtifact) -> Engine:
    assert a.url is not None
    return _Echo(f"{ctx.route}:{a.name}", a.url)


async def test_a_new_engine_is_one_entry_of_the_table(tmp_path: Path) -> None:
    fake = EngineKind("echo", "url", frozenset({Precision.FP8}), "messages", "top_logprobs", _fake)
    repo = demo_repo_copy(tmp_path)
    _edit(
        repo, lambda b: b.update(fp8={"engine": "echo", "url": "http://x:1/v1", "precision": "fp8"})
    )
    settings = default_settings().model_copy(update={"repo": repo})
    refused = Catalog(settings).scan()  # not in the real table: the model is left out
    assert not refused.models and "branches.fp8.engine: unknown engine" in refused.problems[0]
    catalog = Catalog(settings, engines={**ENGINES, "echo": fake})
    [build] = catalog.build_all(catalog.scan())
    engine = next(b.engine for b in build.routes[0].branches if b.name == "fp8")
    assert isinstance(engine, _Echo)
    await engine.start()
    request = GenerationRequest(
        "r", "hi", SamplingParams(max_tokens=len("served by http://x:1/v1"))
    )
    text = "".join([e.text async for e in engine.generate(request) if isinstance(e, TokenEvent)])
    assert text == "served by http://x:1/v1"

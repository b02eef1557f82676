"""ONNX Runtime branches in the repository: the manifest's fields (the graph and its
tokenizer, each with its sha256), their errors naming the file and the field, and the
checks that fail a branch alone — a sha256 that does not match, a missing tokenizer, a
hostile ``model.onnx`` refused in a child bounded in time and memory."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from qrtest import demo_model_dir, demo_repo_copy, ec_keys
from quantroute.engines.table import ENGINES
from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry import onnx_check
from quantroute.registry.digests import Digests
from quantroute.registry.manifest import (
    BranchArtifact,
    load_manifest,
    sha256_file,
    write_manifest,
)
from quantroute.registry.onnx_check import check_onnx
from quantroute.registry.onnx_pair import check_onnx_isolated, read_onnx_isolated
from quantroute.registry.repository import scan_model
from quantroute.registry.signing import TrustPolicy, sign_model, verify_model
from quantroute.types import Precision

onnx = pytest.importorskip("onnx")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's F16 GGUF exported as an int8 ONNX folder (once for the module)."""
    from quantroute.demo.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "onnx_int8"
    export_onnx(demo_model_dir() / "f16.gguf", out, "int8")
    return out


def _edit(repo: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = repo / "tiny-llama" / "quantroute.yaml"
    data = yaml.safe_load(path.read_text())
    change(data["branches"])
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _branch(model_dir: Path, name: str = "onnx_int8") -> dict[str, Any]:
    """The manifest entry of the ONNX folder ``model_dir/name``, sha256s as they are."""
    return {
        "engine": "onnxruntime",
        "file": f"{name}/model.onnx",
        "precision": "int8",
        "sha256": sha256_file(model_dir / name / "model.onnx"),
        "tokenizer": {
            "file": f"{name}/tokenizer.gguf",
            "sha256": sha256_file(model_dir / name / "tokenizer.gguf"),
        },
    }


@pytest.fixture
def repo(tmp_path: Path, exported: Path) -> Path:
    """A copy of the demo repository's GGUF branches, given an ``onnx_int8`` branch
    exported here (the packaged ONNX folders left out: this one is the tests' to damage)."""
    repo = demo_repo_copy(tmp_path, engine="llamacpp")
    model_dir = repo / "tiny-llama"
    shutil.copytree(exported, model_dir / "onnx_int8")
    _edit(repo, lambda b: b.update(onnx_int8=_branch(model_dir)))
    return repo


def _scan(repo: Path, **how: Any) -> dict[str, BranchArtifact]:
    entry = scan_model(repo / "tiny-llama", engines=ENGINES, **how)
    return {a.name: a for a in entry.artifacts}


def _rewrite(repo: Path, relative: str, data: bytes) -> None:
    """Replace a file of the ONNX branch, and its sha256 in the manifest (so the header
    check, not the digest, is what refuses it)."""
    model_dir = repo / "tiny-llama"
    (model_dir / relative).write_bytes(data)
    _edit(repo, lambda b: b.update(onnx_int8=_branch(model_dir)))


def test_an_onnx_branch_hands_its_worker_two_verified_files(repo: Path) -> None:
    artifacts = _scan(repo, isolated=True)
    a = artifacts["onnx_int8"]
    assert a.problem is None and a.engine == "onnxruntime" and a.precision is Precision.INT8
    model, tokenizer = a.verified(), a.verified_tokenizer()
    assert model is not None and tokenizer is not None
    assert (model.label, tokenizer.label) == ("onnx_int8/model.onnx", "onnx_int8/tokenizer.gguf")
    folder = repo / "tiny-llama" / "onnx_int8"
    assert model.sha256 == sha256_file(folder / "model.onnx") == a.sha256
    assert tokenizer.sha256 == sha256_file(folder / "tokenizer.gguf")
    assert artifacts["f16"].verified_tokenizer() is None  # a GGUF branch has none
    # the isolated check kept what the memory model reads, with the tokenizer's context
    summary = read_onnx_isolated(a.path)
    assert (summary.n_layer, summary.n_kv_heads, summary.head_dim) == (2, 4, 64)
    assert (summary.kv_element_bytes, summary.n_vocab, summary.n_ctx_train) == (4, 354, 512)
    assert summary.kv_bytes_per_token == 2 * 2 * 4 * 64 * 4
    assert 0 < summary.weights_bytes <= a.size_bytes


def test_the_manifest_round_trips_an_onnx_branch(repo: Path) -> None:
    model_dir = repo / "tiny-llama"
    manifest = load_manifest(model_dir, ENGINES)
    write_manifest(model_dir, manifest)
    assert load_manifest(model_dir, ENGINES) == manifest
    text = (model_dir / "quantroute.yaml").read_text()
    assert "tokenizer:" in text and "onnx_int8/tokenizer.gguf" in text


_SHA = "0" * 64
_TOKENIZER = {"file": "onnx_int8/tokenizer.gguf", "sha256": _SHA}
_ONNX = {"engine": "onnxruntime", "file": "onnx_int8/model.onnx", "sha256": _SHA}


@pytest.mark.parametrize(
    ("branch", "problem"),
    [
        ({**_ONNX, "precision": "int8"}, "engine onnxruntime needs a tokenizer"),
        (
            {"file": "f16.gguf", "sha256": _SHA, "precision": "f16", "tokenizer": _TOKENIZER},
            "engine llamacpp takes no tokenizer",
        ),
        (
            {**_ONNX, "precision": "q8_0", "tokenizer": _TOKENIZER},
            "engine onnxruntime does not run precision q8_0",
        ),
        (
            {"file": "f16.gguf", "sha256": _SHA, "precision": "int4"},
            "engine llamacpp does not run precision int4",
        ),
        ({**_ONNX, "precision": "fp16", "tokenizer": _TOKENIZER}, "fp16 is written f16"),
        (
            {**_ONNX, "precision": "int8", "tokenizer": {"file": "onnx_int8/tokenizer.gguf"}},
            "branches.onnx_int8.tokenizer.sha256: Field required",
        ),
        (
            {**_ONNX, "precision": "int8", "tokenizer": {**_TOKENIZER, "sha256": "ABC"}},
            "branches.onnx_int8.tokenizer.sha256: sha256 must be 64 lowercase hex digits",
        ),
        (
            {**_ONNX, "precision": "int8", "tokenizer": {**_TOKENIZER, "file": "../t.gguf"}},
            "branches.onnx_int8.tokenizer.file: file must be a path inside the model folder",
        ),
        (
            {**_ONNX, "precision": "int8", "tokenizer": {**_TOKENIZER, "size": 1}},
            "branches.onnx_int8.tokenizer.size: Extra inputs are not permitted",
        ),
        (
            {**_ONNX, "file": "onnx_int8/model.bin", "precision": "int8", "tokenizer": _TOKENIZER},
            "file onnx_int8/model.bin: a branch with a tokenizer is an ONNX graph, named .onnx",
        ),
        (
            {
                "engine": "openai",
                "url": "http://h:1/v1",
                "precision": "int8",
                "tokenizer": _TOKENIZER,
            },
            "a tokenizer is for a file branch",
        ),
    ],
)
def test_a_wrong_onnx_branch_is_a_manifest_error_naming_file_and_field(
    tmp_path: Path, branch: dict[str, Any], problem: str
) -> None:
    repo = demo_repo_copy(tmp_path, engine="llamacpp")
    _edit(repo, lambda b: b.update(onnx_int8=branch))
    with pytest.raises(ManifestError) as caught:
        load_manifest(repo / "tiny-llama", ENGINES)
    assert caught.value.message.startswith("tiny-llama/quantroute.yaml: branches.onnx_int8")
    assert problem in caught.value.message


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda d: (d / "model.onnx").write_bytes(b"\0" + (d / "model.onnx").read_bytes()),
            "tiny-llama:onnx_int8: onnx_int8/model.onnx does not match the manifest's sha256",
        ),
        (
            lambda d: (d / "tokenizer.gguf").write_bytes(b"GGUF" * 4),
            "tiny-llama:onnx_int8: tokenizer onnx_int8/tokenizer.gguf does not match the "
            "manifest's tokenizer.sha256",
        ),
        (
            lambda d: (d / "tokenizer.gguf").unlink(),
            "tiny-llama:onnx_int8: tokenizer onnx_int8/tokenizer.gguf is missing",
        ),
        (
            lambda d: (d / "model.onnx").unlink(),
            "tiny-llama:onnx_int8: file onnx_int8/model.onnx is missing",
        ),
        (
            lambda d: _link_out(d / "tokenizer.gguf"),
            "tiny-llama:onnx_int8: tokenizer onnx_int8/tokenizer.gguf leads out of the model "
            "folder",
        ),
    ],
)
def test_a_file_that_fails_its_check_fails_its_branch_alone(
    repo: Path, damage: Callable[[Path], Any], problem: str
) -> None:
    damage(repo / "tiny-llama" / "onnx_int8")
    artifacts = _scan(repo, isolated=False)
    a = artifacts["onnx_int8"]
    assert a.problem is not None and a.problem.startswith(problem), a.problem
    assert a.verified() is None and a.verified_tokenizer() is None
    assert all(b.problem is None for n, b in artifacts.items() if n != "onnx_int8")
    # never a digest of what the file holds, never an absolute path
    assert str(repo) not in a.problem and not any(c * 16 in a.problem for c in "0123456789abcdef")


def _link_out(path: Path) -> None:
    outside = path.parents[3] / "elsewhere.gguf"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


def _model(folder: Path) -> Any:
    return onnx.load(str(folder / "model.onnx"))


def _huge_dims(folder: Path) -> bytes:
    model = _model(folder)
    weight = next(t for t in model.graph.initializer if len(t.raw_data) > 1024)
    del weight.dims[:]
    weight.dims.extend([1 << 20, 1 << 18])  # 2^38 elements, over a terabyte declared
    return bytes(model.SerializeToString())


def _external(folder: Path) -> bytes:
    model = _model(folder)
    weight = next(t for t in model.graph.initializer if len(t.raw_data) > 1024)
    weight.ClearField("raw_data")
    weight.data_location = onnx.TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../../../../etc/passwd"
    return bytes(model.SerializeToString())


def _no_cache(folder: Path) -> bytes:
    model = _model(folder)
    kept = [i for i in model.graph.input if not i.name.startswith("past_key_values.")]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return bytes(model.SerializeToString())


def _sparse_bomb(folder: Path) -> bytes:
    """A sparse initializer of one value whose dense shape is 2^34 elements (64 GiB of
    floats): ONNX Runtime makes it dense at load."""
    model = _model(folder)
    values = onnx.helper.make_tensor("bomb_values", onnx.TensorProto.FLOAT, [1], [1.0])
    indices = onnx.helper.make_tensor("bomb_indices", onnx.TensorProto.INT64, [1], [0])
    model.graph.sparse_initializer.append(
        onnx.helper.make_sparse_tensor(values, indices, [1 << 17, 1 << 17])
    )
    return bytes(model.SerializeToString())


def _second_name_for_a_layer(folder: Path) -> bytes:
    """``past_key_values.00.key``, a tiny cache beside the real layer 0's: read as layer
    0 it would shrink the memory estimate to nothing."""
    model = _model(folder)
    for part in ("key", "value"):
        model.graph.input.append(
            onnx.helper.make_tensor_value_info(
                f"past_key_values.00.{part}", onnx.TensorProto.FLOAT, ["b", 1, "p", 1]
            )
        )
    return bytes(model.SerializeToString())


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    out, n = bytearray([number << 3 | 2]), len(payload)
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + payload


def _merged_tensor(folder: Path) -> bytes:
    """A Constant whose ``value`` tensor is given twice, each copy sound alone
    (``[2^16]`` int64s): protobuf merges them into one whose dims are ``[2^16, 2^16]``,
    32 GiB declared."""
    tensor = onnx.helper.make_tensor("c", onnx.TensorProto.INT64, [1 << 16], [0] * (1 << 16))
    attribute = onnx.helper.make_attribute("value", tensor).SerializeToString()
    attribute += _field(5, tensor.SerializeToString())  # t, again
    node = _field(2, b"bomb") + _field(4, b"Constant") + _field(5, attribute)
    model = _model(folder)
    graph = model.graph.SerializeToString() + _field(1, node)  # one more node
    model.ClearField("graph")
    return bytes(model.SerializeToString()) + _field(7, graph)


@pytest.mark.parametrize(
    ("hostile", "problem"),
    [
        (lambda f: (f / "model.onnx").read_bytes()[:-5000], "truncated"),
        (_merged_tensor, "a tensor field given twice"),
        (_sparse_bomb, "a sparse tensor over 134217728 elements once dense"),
        (_second_name_for_a_layer, "do not number the layers 0, 1, ..."),
        (lambda f: (f / "tokenizer.gguf").read_bytes(), "not an ONNX file"),
        (lambda f: b"\x3a\xff\xff\xff\xff\x0f" + b"\0" * 64, "runs past its message"),
        (lambda f: b"\x08" + b"\xff" * 12, "over 10 bytes"),
        (_huge_dims, "its dimensions say 549755813888"),  # 2^38 float16s
        (_external, "keeps its data in another file"),
        (_no_cache, "not a decoder with a key/value cache"),
    ],
)
def test_a_hostile_model_onnx_fails_its_branch_in_the_bounded_child(
    repo: Path, exported: Path, hostile: Callable[[Path], bytes], problem: str
) -> None:
    _rewrite(repo, "onnx_int8/model.onnx", hostile(exported))
    started = time.monotonic()
    artifacts = _scan(repo, isolated=True, timeout_s=20.0)
    assert time.monotonic() - started < 20
    a = artifacts["onnx_int8"]
    assert a.problem is not None and a.problem.startswith(
        "tiny-llama:onnx_int8: onnx_int8/model.onnx: "
    )
    assert problem in a.problem
    assert a.verified() is None and a.verified_tokenizer() is None
    assert artifacts["f16"].problem is None


def test_a_tokenizer_without_a_vocabulary_fails_its_branch(repo: Path, tmp_path: Path) -> None:
    import gguf

    empty = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(empty), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _rewrite(repo, "onnx_int8/tokenizer.gguf", empty.read_bytes())
    a = _scan(repo, isolated=True)["onnx_int8"]
    assert a.problem == (
        "tiny-llama:onnx_int8: tokenizer onnx_int8/tokenizer.gguf: a tokenizer without its "
        "vocabulary's metadata"
    )


def test_the_check_is_bounded_in_fields_time_and_memory(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = tmp_path / "many.onnx"
    many.write_bytes(b"\x08\x00" * 1001)  # a thousand and one ir_version fields
    monkeypatch.setattr(onnx_check, "MAX_FIELDS", 1000)
    with pytest.raises(ArtifactIntegrityError, match="over 1000 protobuf fields"):
        check_onnx(many)
    good = (exported / "model.onnx", exported / "tokenizer.gguf")
    (slow,) = check_onnx_isolated([good], timeout_s=0.001)
    assert slow.summary is None and "took over" in (slow.model or "")
    (starved,) = check_onnx_isolated([good], memory_bytes=32 << 20)
    assert starved.summary is None and "memory limit" in (starved.model or "")


def test_a_child_that_dies_fails_only_the_graph_that_killed_it(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose child dies is checked again a graph at a time: only the graph that
    did it is refused."""
    from quantroute.registry import onnx_pair

    real = onnx_pair._run_child
    bad = (tmp_path / "bad.onnx", exported / "tokenizer.gguf")
    bad[0].write_bytes((exported / "model.onnx").read_bytes())
    runs: list[int] = []

    def dying(pairs: list[Any], files: list[Any], timeout_s: float, memory: int) -> list[Any]:
        runs.append(len(pairs))
        if bad in pairs:  # fault injection: this graph "kills" any child that reads it
            failed = f"{onnx_pair._CHILD_FAILED}took over {timeout_s:g} s (refused)"
            return [onnx_pair.PairFound(model=failed)] * len(pairs)
        return real(pairs, files, timeout_s, memory)

    monkeypatch.setattr(onnx_pair, "_run_child", dying)
    good = (exported / "model.onnx", exported / "tokenizer.gguf")
    found = check_onnx_isolated([good, bad])
    assert found[0].summary is not None and found[0].model is None
    assert found[1].summary is None and "took over" in (found[1].model or "")
    assert runs == [2, 1, 1]


def test_a_tokenizer_replaced_on_disk_is_noticed(repo: Path) -> None:
    a = _scan(repo, isolated=False)["onnx_int8"]
    assert not a.replaced()
    tokenizer = repo / "tiny-llama" / "onnx_int8" / "tokenizer.gguf"
    copy = tokenizer.with_suffix(".new")
    shutil.copy(tokenizer, copy)
    copy.replace(tokenizer)  # the same bytes under a new inode: not the file that was checked
    assert a.replaced()


def test_each_file_is_read_once_a_scan(repo: Path) -> None:
    digests = Digests()
    digests.begin()
    _scan(repo, isolated=False, digests=digests)
    assert digests.reads == 5  # three GGUF branches, the graph and its tokenizer


def test_a_signed_model_covers_its_onnx_files(repo: Path, tmp_path: Path) -> None:
    private, public = ec_keys(tmp_path, "signing")
    model_dir = repo / "tiny-llama"
    sign_model(model_dir, private_key=private)
    trust = TrustPolicy(required=True, public_key=public)
    assert verify_model(model_dir, trust) is not None
    entry = scan_model(model_dir, trust, isolated=False, engines=ENGINES)
    assert entry.signed["onnx_int8/tokenizer.gguf"] == sha256_file(
        model_dir / "onnx_int8" / "tokenizer.gguf"
    )
    (model_dir / "onnx_int8" / "tokenizer.gguf").write_bytes(b"GGUF" * 4)
    with pytest.raises(ArtifactIntegrityError, match="changed since signing"):
        verify_model(model_dir, trust)


def test_the_onnx_precisions_have_their_specs_and_routing_costs() -> None:
    from quantroute.routing.score import BITS, RANK
    from quantroute.types import PrecisionSpec

    # MatMulNBits in blocks of 32: the bits, a float32 scale and a zero point per block
    assert Precision("int8").spec == PrecisionSpec(8 + 1 + 8 / 32, 3, gguf=False)
    assert Precision("int4").spec == PrecisionSpec(4 + 1 + 4 / 32, 6, gguf=False)
    assert Precision.Q8_0.spec.rank == Precision.INT8.spec.rank  # int8 is q8_0's league
    assert Precision.Q4_K_M.spec.rank == Precision.INT4.spec.rank  # int4 is q4_k_m's
    assert set(BITS) == set(RANK) == set(Precision)  # every precision has a routing cost
    assert not (set(ENGINES["llamacpp"].precisions) & {Precision.INT8, Precision.INT4})


def test_validate_checks_an_onnx_file_with_its_tokenizer(exported: Path, tmp_path: Path) -> None:
    """``quantroute validate FILE.onnx`` runs the ONNX check (not the GGUF one), with the
    ``tokenizer.gguf`` beside it."""
    from quantroute.cli import main

    folder = tmp_path / "onnx_int8"
    shutil.copytree(exported, folder)
    assert main(["validate", str(folder / "model.onnx")]) == 0
    (folder / "tokenizer.gguf").write_bytes(b"GGUF but not really")
    assert main(["validate", str(folder / "model.onnx")]) == 1
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[: len(data) // 2])  # truncated
    assert main(["validate", str(folder / "model.onnx")]) == 1

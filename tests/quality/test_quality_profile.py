"""The profiler on the packaged demo model (real llama.cpp), and ``profile.json``'s life cycle."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import quantroute
from quantroute.errors import ArtifactIntegrityError, ConfigError, NotFoundError
from quantroute.quality import (
    PROFILE_NAME,
    BranchProfile,
    ProfileResult,
    find_model_dirs,
    format_table,
    load_profiles,
    profile_repo,
)
from quantroute.quality.metrics import KldAccumulator
from quantroute.quality.profiler import default_calibration_text
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    load_manifest,
    sha256_file,
    verify_artifacts,
    write_manifest,
)

DEMO = Path(quantroute.__file__).resolve().parent / "demo" / "repo" / "tiny-llama"
N_CTX = 128
CHUNKS = 6
FAST = {"n_ctx": N_CTX, "max_chunks": CHUNKS, "n_threads": 1, "decode_tokens": 16}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DEMO / MANIFEST_NAME).is_file(), reason="demo model not built (quantroute demo build)"
    ),
]


def copy_model(dst: Path) -> Path:
    """The demo model's GGUF branches under ``dst``: their files, and a manifest listing
    only them (these tests are llama.cpp's; ``test_profile_onnx`` profiles the ONNX
    branches, and six branches would cost these runs twice the time)."""
    dst.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(DEMO)
    ggufs = {n: s for n, s in manifest.branches.items() if s.engine == "llamacpp"}
    assert list(ggufs) == ["f16", "q8_0", "q4_k_m"]
    for spec in ggufs.values():
        assert spec.file is not None
        shutil.copy2(DEMO / spec.file, dst / spec.file)
    write_manifest(dst, manifest.model_copy(update={"branches": ggufs}))
    return dst


def rewrite_branch(model_dir: Path, branch: str) -> None:
    """Change one byte of a branch's file and record its new sha256 in the manifest."""
    manifest = load_manifest(model_dir)
    spec = manifest.branches[branch]
    path = model_dir / spec.file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte is tensor data: the file still loads
    path.write_bytes(bytes(data))
    branches = dict(manifest.branches)
    branches[branch] = spec.model_copy(update={"sha256": sha256_file(path)})
    write_manifest(model_dir, manifest.model_copy(update={"branches": branches}))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[ProfileResult, ProfileResult]:
    """Two independent profile runs of the demo model, each in its own copy."""
    runs = []
    for name in ("run1", "run2"):
        model_dir = copy_model(tmp_path_factory.mktemp(name) / "tiny-llama")
        runs.append(profile_repo(model_dir.parent, progress=False, plot=name == "run1", **FAST))
    return runs[0], runs[1]


def by_branch(result: ProfileResult) -> dict[str, BranchProfile]:
    return {p.branch: p for p in result.models[0].branches}


def test_quality_is_monotone_in_precision(profiled: tuple[ProfileResult, ProfileResult]) -> None:
    result = profiled[0]
    (model,) = result.models
    assert model.method.n_ctx == N_CTX and model.method.n_chunks == CHUNKS
    assert model.method.n_scored_tokens == CHUNKS * (N_CTX - 1 - N_CTX // 2)
    p = by_branch(result)
    assert list(p) == ["f16", "q8_0", "q4_k_m"]  # reference first
    f16, q8, q4 = p["f16"], p["q8_0"], p["q4_k_m"]
    assert f16.mean_kld == 0.0 and f16.top1 == 1.0 and f16.quality.ln_ppl_ratio == 0.0
    assert 0.0 < q8.mean_kld < q4.mean_kld
    assert q8.kld_p99 < q4.kld_p99
    assert 1.0 >= q8.top1 > q4.top1
    assert q4.quality.n_tokens == model.method.n_scored_tokens
    for b in (f16, q8, q4):
        assert b.decode_tps > 0 and b.prefill_tps > 0 and b.rss_bytes > 0
        assert b.file_bytes == (model.model_dir / f"{b.branch}.gguf").stat().st_size
    assert f16.file_bytes > q8.file_bytes > q4.file_bytes


def test_quality_is_reproducible_run_to_run(
    profiled: tuple[ProfileResult, ProfileResult],
) -> None:
    first, second = (by_branch(r) for r in profiled)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].quality == second[name].quality, name


def test_matches_an_independent_llama_cpp_python_evaluation(tmp_path: Path) -> None:
    """Re-derive chunk 0 through llama-cpp-python's high-level ``Llama`` (logits for all rows).

    Flash attention on, as llama.cpp's default (auto) context picks on CPU, which the
    profiler, llama-perplexity and the serving worker all use.
    """
    from llama_cpp import Llama

    first = N_CTX // 2
    rows: dict[str, np.ndarray] = {}
    for branch in ("f16", "q4_k_m"):
        llm = Llama(
            str(DEMO / f"{branch}.gguf"),
            n_ctx=N_CTX,
            logits_all=True,
            flash_attn=True,
            n_threads=1,
            verbose=False,
        )
        try:
            tokens = llm.tokenize(default_calibration_text().encode(), add_bos=True)
            chunk = list(tokens[:N_CTX])
            target = np.array(chunk[first + 1 :])
            chunk[0] = llm.token_bos()
            llm.reset()
            llm.eval(chunk)
            rows[branch] = np.array(llm.scores[first : N_CTX - 1], dtype=np.float32)  # [S, V]
        finally:
            llm.close()
    acc = KldAccumulator()
    acc.add_logits(rows["f16"], rows["q4_k_m"], target)
    expected = acc.result()

    model_dir = copy_model(tmp_path / "tiny-llama")
    one = profile_repo(
        model_dir, progress=False, plot=False, **{**FAST, "max_chunks": 1, "decode_tokens": 4}
    )
    got = by_branch(one)["q4_k_m"].quality
    assert got.n_tokens == expected.n_tokens == N_CTX - 1 - first
    assert got.mean_kld == pytest.approx(expected.mean_kld, rel=1e-6)
    assert got.top1 == expected.top1
    assert got.ppl_q == pytest.approx(expected.ppl_q, rel=1e-6)


def test_profile_json_round_trips(profiled: tuple[ProfileResult, ProfileResult]) -> None:
    model = profiled[0].models[0]
    assert model.profile_path == model.model_dir / PROFILE_NAME
    assert model.profile_path.stat().st_mode & 0o644 == 0o644  # readable by the serving user
    raw = json.loads(model.profile_path.read_text())
    assert raw["version"] == 1 and raw["model"] == "tiny-llama"
    assert raw["reference"]["branch"] == "f16"
    assert raw["method"]["tool"] == "quantroute profile"
    assert raw["method"]["reference_branch"] == "f16"
    artifacts = verify_artifacts(model.model_dir, load_manifest(model.model_dir))
    assert set(raw["branches"]) == {a.sha256 for a in artifacts}

    loaded, warnings = load_profiles(model.model_dir, artifacts)
    assert warnings == []
    assert loaded == {p.branch: p for p in model.branches}


def test_plot_and_table(profiled: tuple[ProfileResult, ProfileResult]) -> None:
    pytest.importorskip("matplotlib")
    model = profiled[0].models[0]
    assert model.plot_path is not None
    assert model.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert profiled[1].models[0].plot_path is None
    table = format_table(profiled[0])
    lines = table.splitlines()
    assert lines[0].startswith("tiny-llama: reference f16, n_ctx 128, 6 chunks")
    q4_line = next(line for line in lines if line.startswith("q4_k_m"))
    assert f"{by_branch(profiled[0])['q4_k_m'].mean_kld:.6f}" in q4_line
    assert format_table(model) == table


def test_changed_branch_file_invalidates_only_its_profile(
    profiled: tuple[ProfileResult, ProfileResult], tmp_path: Path
) -> None:
    src = profiled[0].models[0].model_dir
    model_dir = copy_model(tmp_path / "tiny-llama")
    shutil.copy2(src / PROFILE_NAME, model_dir / PROFILE_NAME)
    rewrite_branch(model_dir, "q4_k_m")

    artifacts = verify_artifacts(model_dir, load_manifest(model_dir))
    loaded, warnings = load_profiles(model_dir, artifacts)
    assert loaded["q4_k_m"] is None
    assert loaded["f16"] is not None and loaded["q8_0"] is not None
    assert len(warnings) == 1
    assert "tiny-llama:q4_k_m" in warnings[0] and "changed since it was profiled" in warnings[0]


def test_changed_reference_invalidates_every_profile(
    profiled: tuple[ProfileResult, ProfileResult], tmp_path: Path
) -> None:
    model_dir = copy_model(tmp_path / "tiny-llama")
    shutil.copy2(profiled[0].models[0].model_dir / PROFILE_NAME, model_dir / PROFILE_NAME)
    rewrite_branch(model_dir, "f16")
    loaded, warnings = load_profiles(
        model_dir, verify_artifacts(model_dir, load_manifest(model_dir))
    )
    assert set(loaded.values()) == {None}
    assert len(warnings) == 1 and "reference f16" in warnings[0]


@pytest.mark.parametrize("content", [None, "{not json", '{"version": 2}'])
def test_missing_or_bad_profile_gives_none_and_a_warning(
    tmp_path: Path, content: str | None
) -> None:
    model_dir = copy_model(tmp_path / "tiny-llama")
    if content is not None:
        (model_dir / PROFILE_NAME).write_text(content)
    loaded, warnings = load_profiles(
        model_dir, verify_artifacts(model_dir, load_manifest(model_dir))
    )
    assert loaded == {"f16": None, "q8_0": None, "q4_k_m": None}
    assert len(warnings) == 1 and warnings[0].startswith("tiny-llama: ")


def test_find_model_dirs(tmp_path: Path) -> None:
    model_dir = copy_model(tmp_path / "repo" / "tiny-llama")
    assert find_model_dirs(tmp_path / "repo") == [model_dir]
    assert find_model_dirs(model_dir) == [model_dir]
    assert find_model_dirs(tmp_path / "repo", "tiny-llama") == [model_dir]
    with pytest.raises(NotFoundError):
        find_model_dirs(tmp_path / "repo", "no-such-model")
    with pytest.raises(ConfigError):
        find_model_dirs(tmp_path / "empty-nothing-here")


def test_text_too_short_for_n_ctx_is_a_config_error(tmp_path: Path) -> None:
    model_dir = copy_model(tmp_path / "tiny-llama")
    with pytest.raises(ConfigError, match="needs at least 256"):
        profile_repo(model_dir, text="x = 1\n" * 20, progress=False, **FAST)
    assert not (model_dir / PROFILE_NAME).exists()


def test_a_truncated_branch_fails_cleanly_before_llama_cpp_reads_it(tmp_path: Path) -> None:
    model_dir = copy_model(tmp_path / "tiny-llama")
    manifest = load_manifest(model_dir)
    path = model_dir / manifest.branches["q8_0"].file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # tensor data cut short
    spec = manifest.branches["q8_0"].model_copy(update={"sha256": sha256_file(path)})
    write_manifest(
        model_dir, manifest.model_copy(update={"branches": {**manifest.branches, "q8_0": spec}})
    )
    with pytest.raises(ArtifactIntegrityError, match=r"q8_0\.gguf.*past the end of the file"):
        profile_repo(model_dir, progress=False, plot=False, **{**FAST, "max_chunks": 1})
    assert not (model_dir / PROFILE_NAME).exists()


def test_branch_profile_is_frozen(profiled: tuple[ProfileResult, ProfileResult]) -> None:
    p = profiled[0].models[0].branches[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.decode_tps = 1.0  # type: ignore[misc]

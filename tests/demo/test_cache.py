"""The demo build cache: keyed by every input, built once, reused, rebuilt when damaged.

Builds here use a micro config (a 400-token vocabulary, one layer, two training
steps) so that each takes seconds; the realistic model's own build is checked
in test_realistic.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import quantroute.demo.cache as cache
from quantroute.cli import build_parser
from quantroute.demo import (
    BPE_MODEL_NAME,
    DEFAULT_REPO_DIR,
    DEMO_MODELS,
    BpeBuildConfig,
    BpeConfig,
    ModelConfig,
    TrainConfig,
    cache_key,
    default_cache_root,
    ensure_demo_repo,
    read_metadata,
)
from quantroute.errors import NotFoundError
from quantroute.registry.manifest import MANIFEST_NAME, load_manifest, verify_artifacts

MICRO = BpeBuildConfig(
    model=ModelConfig(n_embd=256, n_layer=1, n_head=4, n_head_kv=2, n_ff=256, context_length=128),
    train=TrainConfig(steps=2, batch_size=2, seq_len=64, warmup_steps=1, val_batches=1),
    bpe=BpeConfig(vocab_size=400),
    max_corpus_bytes=100_000,
    chats_per_file=1,
    profile=False,
)


# --- the key ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_key() -> cache.CacheKey:
    return cache_key(BPE_MODEL_NAME, MICRO, 0)


def test_the_key_is_stable_and_recorded(base_key: cache.CacheKey) -> None:
    a, b = base_key, cache_key(BPE_MODEL_NAME, MICRO, 0)
    assert a == b
    assert len(a.digest) == 64
    assert a.folder == f"{BPE_MODEL_NAME}-{a.digest[:16]}"
    assert set(a.inputs) == {
        "name",
        "seed",
        "config",
        "code",
        "corpus",
        "calibration",
        "python",
        "versions",
    }
    assert a.inputs["config"]["train"]["steps"] == 2
    assert set(a.inputs["versions"]) == {"torch", "tokenizers", "llama_cpp_python", "gguf", "numpy"}
    assert a.inputs["versions"]["llama_cpp_python"] == "0.3.36"


@pytest.mark.parametrize(
    "changed",
    [
        replace(MICRO, train=replace(MICRO.train, steps=3)),
        replace(MICRO, train=replace(MICRO.train, lr=1e-3)),
        replace(MICRO, model=replace(MICRO.model, n_layer=2)),
        replace(MICRO, model=replace(MICRO.model, n_head_kv=1)),
        replace(MICRO, bpe=replace(MICRO.bpe, vocab_size=401)),
        replace(MICRO, max_corpus_bytes=120_000),
        replace(MICRO, chats_per_file=2),
        replace(MICRO, profile=True),
    ],
    ids=["steps", "lr", "layers", "kv-heads", "vocab", "corpus-cap", "chats", "profile"],
)
def test_a_config_change_changes_the_key(changed: BpeBuildConfig, base_key: cache.CacheKey) -> None:
    assert cache_key(BPE_MODEL_NAME, changed, 0).digest != base_key.digest


def test_the_seed_code_corpus_and_libraries_are_in_the_key(
    monkeypatch: pytest.MonkeyPatch, base_key: cache.CacheKey
) -> None:
    base = base_key.digest
    assert cache_key(BPE_MODEL_NAME, MICRO, 1).digest != base
    with monkeypatch.context() as m:
        m.setattr(cache, "code_version", lambda: "edited")
        assert cache_key(BPE_MODEL_NAME, MICRO, 0).digest != base
    with monkeypatch.context() as m:
        m.setattr(cache, "corpus_fingerprint", lambda **_: "another python")
        assert cache_key(BPE_MODEL_NAME, MICRO, 0).digest != base
    with monkeypatch.context() as m:
        m.setattr(cache, "_version", lambda package: "9.9" if package == "torch" else "1")
        assert cache_key(BPE_MODEL_NAME, MICRO, 0).digest != base
    assert cache_key(BPE_MODEL_NAME, MICRO, 0).digest == base


def test_the_code_version_covers_the_demo_package() -> None:
    version = cache.code_version()
    assert len(version) == 64
    assert version == cache.code_version()


def test_the_code_digest_ignores_docstrings_and_comments_only() -> None:
    code = "def f(x):\n    return x + 1\n"
    documented = '"""Module."""\n\n\ndef f(x):  # why\n    """Add one."""\n    return x + 1\n'
    assert cache.code_digest(documented) == cache.code_digest(code)
    assert cache.code_digest('def f(x):\n    """Only a docstring."""\n') == cache.code_digest(
        "def f(x):\n    pass\n"
    )
    assert cache.code_digest(code.replace("1", "2")) != cache.code_digest(code)
    assert cache.code_digest(code.replace("x + 1", "1 + x")) != cache.code_digest(code)


def test_the_corpus_fingerprint_follows_the_selection() -> None:
    a = cache.corpus_fingerprint(seed=0, max_bytes=50_000)
    assert a == cache.corpus_fingerprint(seed=0, max_bytes=50_000)
    assert a != cache.corpus_fingerprint(seed=1, max_bytes=50_000)
    assert a != cache.corpus_fingerprint(seed=0, max_bytes=80_000)


# --- names -----------------------------------------------------------------------------


def test_tiny_llama_is_the_packaged_repository(tmp_path: Path) -> None:
    assert DEMO_MODELS == ("tiny-llama", "stdlib-bpe-llama")
    repo = ensure_demo_repo("tiny-llama", cache_root=tmp_path)
    assert repo == DEFAULT_REPO_DIR.parent
    assert (repo / "tiny-llama" / MANIFEST_NAME).is_file()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="packaged"):
        ensure_demo_repo("tiny-llama", rebuild=True)


def test_an_unknown_demo_model_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="stdlib-bpe-llama"):
        ensure_demo_repo("gpt-5", cache_root=tmp_path)


def test_the_default_cache_is_outside_the_repository() -> None:
    root = default_cache_root()
    assert root == Path.home() / ".cache" / "quantroute" / "demo"
    assert DEFAULT_REPO_DIR.parent not in root.parents


def test_the_cli_offers_every_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["demo", "build", "--model", "stdlib-bpe-llama", "--steps", "5"])
    assert (args.model, args.steps, args.out, args.rebuild) == ("stdlib-bpe-llama", 5, None, False)
    assert parser.parse_args(["demo", "build"]).model == "tiny-llama"
    for name in DEMO_MODELS:
        assert parser.parse_args(["demo", "build", "--model", name]).model == name
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "build", "--model", "gpt-5"])
    assert "invalid choice" in capsys.readouterr().err


# --- building and reusing --------------------------------------------------------------


class _CountingBuild:
    def __init__(self) -> None:
        self.calls: list[Path] = []
        self.real = cache.build_bpe_demo

    def __call__(self, out_dir: Path, **kwargs: Any) -> Any:
        self.calls.append(out_dir)
        return self.real(out_dir, **kwargs)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _CountingBuild:
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    pytest.importorskip("llama_cpp")
    spy = _CountingBuild()
    monkeypatch.setattr(cache, "build_bpe_demo", spy)
    return spy


@pytest.mark.slow
def test_ensure_builds_once_then_reuses(tmp_path: Path, counting: _CountingBuild) -> None:
    repo = ensure_demo_repo(cache_root=tmp_path, config=MICRO, progress=False)
    key = cache_key(BPE_MODEL_NAME, MICRO, 0)
    assert repo == tmp_path / key.folder
    assert len(counting.calls) == 1
    model_dir = repo / BPE_MODEL_NAME
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "f16.gguf",
        "q4_k_m.gguf",
        "q8_0.gguf",
        "quantroute.yaml",
        "tokenizer.json",
    ]
    verify_artifacts(model_dir, load_manifest(model_dir))
    info = json.loads((repo / "build.json").read_text())
    assert info["key"] == key.digest
    assert info["inputs"] == key.inputs
    assert info["build_seconds"] > 0
    # nothing half-built is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key.folder, f".{key.folder}.lock"])
    stamp = (model_dir / "f16.gguf").stat().st_mtime_ns

    assert ensure_demo_repo(cache_root=tmp_path, config=MICRO, progress=False) == repo
    assert len(counting.calls) == 1
    assert (model_dir / "f16.gguf").stat().st_mtime_ns == stamp

    other = ensure_demo_repo(cache_root=tmp_path, config=MICRO, seed=1, progress=False)
    assert other != repo
    assert len(counting.calls) == 2
    assert read_metadata(other / BPE_MODEL_NAME / "f16.gguf")["quantroute.demo.seed"] == 1
    assert read_metadata(repo / BPE_MODEL_NAME / "f16.gguf")["quantroute.demo.seed"] == 0


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_to_the_same_bytes(
    tmp_path: Path, counting: _CountingBuild
) -> None:
    repo = ensure_demo_repo(cache_root=tmp_path, config=MICRO, progress=False)
    model_dir = repo / BPE_MODEL_NAME
    first = {n: b.sha256 for n, b in load_manifest(model_dir).branches.items()}
    with (model_dir / "q8_0.gguf").open("ab") as fh:
        fh.write(b"\0")

    assert ensure_demo_repo(cache_root=tmp_path, config=MICRO, progress=False) == repo
    assert len(counting.calls) == 2
    verify_artifacts(model_dir, load_manifest(model_dir))
    # seeded and deterministic: the rebuild is byte for byte the first build
    assert {n: b.sha256 for n, b in load_manifest(model_dir).branches.items()} == first

    ensure_demo_repo(cache_root=tmp_path, config=MICRO, progress=False, rebuild=True)
    assert len(counting.calls) == 3


@pytest.mark.slow
def test_a_profiled_micro_build(tmp_path: Path, counting: _CountingBuild) -> None:
    config = replace(MICRO, profile=True, profile_n_ctx=64, profile_max_chunks=3)
    repo = ensure_demo_repo(cache_root=tmp_path, config=config, progress=False)
    model_dir = repo / BPE_MODEL_NAME
    profile = json.loads((model_dir / "profile.json").read_text())
    manifest = load_manifest(model_dir)
    assert profile["model"] == BPE_MODEL_NAME
    assert profile["method"]["n_ctx"] == 64
    assert set(profile["branches"]) == {b.sha256 for b in manifest.branches.values()}
    assert (model_dir / "profile.png").is_file()

"""The demo builder, the GGUF rewriting helpers, and the packaged demo model."""

from __future__ import annotations

import re
import string
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

import quantroute.demo
from quantroute.demo import (
    DEFAULT_REPO_DIR,
    BuildConfig,
    ModelConfig,
    TrainConfig,
    build_demo,
    copy_gguf_with_metadata,
    perturb_gguf_weights,
    read_llama_gguf,
    read_metadata,
)
from quantroute.demo.onnx_export import DEMO_ONNX_BRANCHES
from quantroute.demo.vocab import VOCAB
from quantroute.registry.manifest import load_manifest, verify_artifacts
from quantroute.types import Precision

llama_cpp = pytest.importorskip("llama_cpp")

MICRO = BuildConfig(
    model=ModelConfig(n_embd=256, n_layer=1, n_head=4, n_ff=256),
    train=TrainConfig(batch_size=2, seq_len=32, warmup_steps=1, val_batches=1),
    max_corpus_bytes=100_000,
)
PY_WORDS = ("def", "return", "self", "if", "for", "in", "import", "None", "not", "is", "else")


def _load(path: Path, **kwargs: object) -> object:
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, **kwargs)


def _tensor_types(path: Path) -> dict[str, gguf.GGMLQuantizationType]:
    return {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}


# --- the public surface ----------------------------------------------------------------


def test_every_exported_name_exists() -> None:
    for name in quantroute.demo.__all__:
        assert hasattr(quantroute.demo, name), name


def test_import_does_not_need_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import quantroute.demo; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- a micro build ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("micro") / "tiny-llama"
    build_demo(out, steps=3, seed=7, progress=False, config=MICRO)
    return out


@pytest.mark.slow
def test_micro_build_writes_a_verified_repository(micro_repo: Path) -> None:
    manifest = load_manifest(micro_repo)
    assert manifest.model == "tiny-llama"
    assert manifest.reference == "f16"
    assert {n: b.precision for n, b in manifest.branches.items()} == {
        "f16": Precision.F16,
        "q8_0": Precision.Q8_0,
        "q4_k_m": Precision.Q4_K_M,
    }
    artifacts = verify_artifacts(micro_repo, manifest)
    assert artifacts[0].name == "f16"
    # only the shipped files remain: no F32 intermediate, no scratch folder
    assert sorted(p.name for p in micro_repo.iterdir()) == [
        "f16.gguf",
        "q4_k_m.gguf",
        "q8_0.gguf",
        "quantroute.yaml",
    ]
    size = {a.name: a.size_bytes for a in artifacts}
    assert size["f16"] > size["q8_0"] > size["q4_k_m"]


@pytest.mark.slow
def test_micro_build_quantizes_with_the_declared_types(micro_repo: Path) -> None:
    q = gguf.GGMLQuantizationType
    f16 = _tensor_types(micro_repo / "f16.gguf")
    q8 = _tensor_types(micro_repo / "q8_0.gguf")
    q4 = _tensor_types(micro_repo / "q4_k_m.gguf")
    assert f16["blk.0.ffn_up.weight"] == q.F16
    assert f16["blk.0.attn_norm.weight"] == q.F32
    assert q8["blk.0.attn_q.weight"] == q.Q8_0
    assert q4["blk.0.attn_q.weight"] == q.Q4_K
    meta = read_metadata(micro_repo / "q4_k_m.gguf")
    assert meta["general.name"] == "tiny-llama"
    assert meta["quantroute.demo.seed"] == 7
    assert meta["quantroute.demo.steps"] == 3
    assert meta["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


@pytest.mark.slow
def test_micro_build_loads_and_generates(micro_repo: Path) -> None:
    for name in ("f16", "q8_0", "q4_k_m"):
        llm = _load(micro_repo / f"{name}.gguf")
        out = llm.create_completion("def ", max_tokens=8, temperature=0.0)  # type: ignore[attr-defined]
        assert out["usage"]["completion_tokens"] >= 1
        llm.close()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_micro_build_is_reproducible(micro_repo: Path, tmp_path: Path) -> None:
    again = build_demo(tmp_path / "again", steps=3, seed=7, progress=False, config=MICRO)
    first = load_manifest(micro_repo)
    assert {n: b.sha256 for n, b in again.branches.items()} == {
        n: b.sha256 for n, b in first.branches.items()
    }


def test_build_rejects_zero_steps_or_seconds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps"):
        build_demo(tmp_path, steps=0, progress=False, config=MICRO)
    with pytest.raises(ValueError, match="max_seconds"):
        build_demo(tmp_path, max_seconds=0, progress=False, config=MICRO)
    assert list(tmp_path.iterdir()) == []


def test_training_stops_at_the_time_cap() -> None:
    pytest.importorskip("torch")
    from quantroute.demo.model import init_params, train

    config = ModelConfig(n_embd=32, n_layer=1, n_head=2, n_ff=32)
    stream = VOCAB.encode_array("def f(x):\n    return x\n" * 200, add_eos=True)
    cfg = TrainConfig(steps=100_000, batch_size=2, seq_len=16, val_batches=1, max_seconds=0.3)
    result = train(init_params(config, 0), config, stream, cfg, progress=False)
    assert result.hit_time_cap
    assert 0 < result.steps_run < 100_000
    assert result.tokens_seen == result.steps_run * 2 * 16


# --- the packaged model ----------------------------------------------------------------


def test_packaged_files_match_the_manifest_and_fit_the_budget() -> None:
    manifest = load_manifest(DEFAULT_REPO_DIR)
    assert manifest.model == "tiny-llama"
    assert manifest.reference == "f16"
    assert set(manifest.branches) == {"f16", "q8_0", "q4_k_m", *DEMO_ONNX_BRANCHES}
    artifacts = verify_artifacts(DEFAULT_REPO_DIR, manifest)  # raises on a sha256 mismatch
    files = [f for f in DEFAULT_REPO_DIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 20 * 1024 * 1024  # what git carries
    assert sum(a.size_bytes for a in artifacts) < sum(f.stat().st_size for f in files)
    assert not (DEFAULT_REPO_DIR / "f32.gguf").exists()


def test_packaged_metadata_records_how_it_was_trained() -> None:
    meta = read_metadata(DEFAULT_REPO_DIR / "f16.gguf")
    assert meta["general.name"] == "tiny-llama"
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == 512
    assert meta["quantroute.demo.seed"] == 0
    assert isinstance(meta["quantroute.demo.steps"], int)
    assert meta["quantroute.demo.steps"] > 100


@pytest.fixture(scope="module")
def packaged_f16() -> Iterator[object]:
    llm = _load(DEFAULT_REPO_DIR / "f16.gguf")
    yield llm
    llm.close()  # type: ignore[attr-defined]


def test_packaged_model_writes_python_like_text(packaged_f16: object) -> None:
    prompt = "def "
    out = packaged_f16.create_completion(  # type: ignore[attr-defined]
        prompt, max_tokens=200, temperature=0.0, repeat_penalty=1.0
    )
    assert out["usage"]["completion_tokens"] >= 100
    text = prompt + out["choices"][0]["text"]
    printable = sum(c in string.printable for c in text) / len(text)
    assert printable >= 0.95, text
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert len(words & set(PY_WORDS)) >= 3, text
    assert "self." in text, text
    assert len([line for line in text.splitlines() if line.strip()]) >= 3, text


def _mean_kld(ref: np.ndarray, other: np.ndarray) -> float:
    # rows are logits [T, V]; KL(ref || other) per position, averaged
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(other)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


@pytest.mark.slow
def test_packaged_branches_lose_quality_in_order() -> None:
    text = (Path(gguf.__file__).parent / "gguf_reader.py").read_text()[:1500]
    logits = {}
    for name in ("f16", "q8_0", "q4_k_m"):
        llm = _load(DEFAULT_REPO_DIR / f"{name}.gguf", logits_all=True)
        tokens = llm.tokenize(text.encode())[:400]  # type: ignore[attr-defined]
        llm.eval(tokens)  # type: ignore[attr-defined]
        logits[name] = np.array(llm.scores[: len(tokens)])  # type: ignore[attr-defined]  # [T, V]
        llm.close()  # type: ignore[attr-defined]
    q8 = _mean_kld(logits["f16"], logits["q8_0"])
    q4 = _mean_kld(logits["f16"], logits["q4_k_m"])
    assert 0 < q8 < q4, (q8, q4)
    assert q4 > 3 * q8


@pytest.mark.slow
def test_llama_cpp_computes_what_torch_trained() -> None:
    # A RoPE pairing or weight layout that differs between training and llama.cpp
    # would show here as a large divergence on a trained model.
    torch = pytest.importorskip("torch")
    from quantroute.demo.model import forward

    path = DEFAULT_REPO_DIR / "f16.gguf"
    config, weights = read_llama_gguf(path)
    text = "import os\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
    ids = VOCAB.encode(text * 3)
    params = {name: torch.from_numpy(w) for name, w in weights.items()}
    with torch.no_grad():
        ref = forward(params, config, torch.tensor([ids]))[0].numpy()  # [T, V]
    llm = _load(path, logits_all=True)
    llm.eval(ids)  # type: ignore[attr-defined]
    got = np.array(llm.scores[: len(ids)])  # type: ignore[attr-defined]  # [T, V]
    llm.close()  # type: ignore[attr-defined]
    assert _mean_kld(ref, got) < 1e-4  # measured 1.5e-7; neox-style RoPE gives 2.9
    assert (ref.argmax(-1) == got.argmax(-1)).mean() > 0.99


# --- rewriting GGUF files --------------------------------------------------------------


def test_copy_gguf_with_metadata_round_trips(tmp_path: Path) -> None:
    src = DEFAULT_REPO_DIR / "q4_k_m.gguf"
    dst = tmp_path / "chat.gguf"
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ ''.__class__ }}"
    copy_gguf_with_metadata(src, dst, {"tokenizer.chat_template": template, "general.name": "x"})

    before, after = read_metadata(src), read_metadata(dst)
    assert after["tokenizer.chat_template"] == template
    assert after["general.name"] == "x"
    assert {
        k: v for k, v in after.items() if k not in ("tokenizer.chat_template", "general.name")
    } == {k: v for k, v in before.items() if k != "general.name"}
    old, new = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    for a, b in zip(old.tensors, new.tensors, strict=True):
        assert a.tensor_type == b.tensor_type
        assert np.array_equal(a.data, b.data), a.name

    llm = _load(dst)
    assert llm.metadata["tokenizer.chat_template"] == template  # type: ignore[attr-defined]
    assert llm.create_completion("x", max_tokens=2)["choices"]  # type: ignore[attr-defined]
    llm.close()  # type: ignore[attr-defined]


def test_copy_gguf_with_metadata_may_overwrite_its_source(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    copy_gguf_with_metadata(DEFAULT_REPO_DIR / "q8_0.gguf", path, {"quantroute.tag": "a"})
    copy_gguf_with_metadata(path, path, {"quantroute.tag": "b"})
    assert read_metadata(path)["quantroute.tag"] == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp files left


def test_perturb_gguf_weights_adds_relative_noise_to_float_tensors_only(tmp_path: Path) -> None:
    f16 = DEFAULT_REPO_DIR / "f16.gguf"
    perturb_gguf_weights(f16, tmp_path / "a.gguf", scale=0.05, seed=1)
    perturb_gguf_weights(f16, tmp_path / "b.gguf", scale=0.05, seed=1)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()

    old = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    new = {t.name: t for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    for name, t in old.items():
        w = np.asarray(t.data, dtype=np.float64)
        delta = np.asarray(new[name].data, dtype=np.float64) - w
        rel = np.sqrt(np.mean(delta**2)) / np.sqrt(np.mean(w**2))
        assert new[name].tensor_type == t.tensor_type
        assert 0.04 < rel < 0.06, (name, rel)

    q4 = DEFAULT_REPO_DIR / "q4_k_m.gguf"
    perturb_gguf_weights(q4, tmp_path / "q.gguf", scale=0.05, seed=1)
    q_old = {t.name: t for t in gguf.GGUFReader(q4).tensors}
    q_new = {t.name: t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    quantized = [n for n, t in q_old.items() if t.tensor_type == gguf.GGMLQuantizationType.Q4_K]
    assert quantized
    for name in quantized:
        assert np.array_equal(q_old[name].data, q_new[name].data)
    assert not np.array_equal(q_old["output_norm.weight"].data, q_new["output_norm.weight"].data)

    llm = _load(tmp_path / "a.gguf")
    assert llm.create_completion("def ", max_tokens=4)["choices"]  # type: ignore[attr-defined]
    llm.close()  # type: ignore[attr-defined]


def test_perturb_with_zero_scale_keeps_the_weights(tmp_path: Path) -> None:
    src = DEFAULT_REPO_DIR / "f16.gguf"
    perturb_gguf_weights(src, tmp_path / "same.gguf", scale=0.0, seed=3)
    old, new = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "same.gguf")
    for a, b in zip(old.tensors, new.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name

"""ONNX branches exported from the demo's F16 GGUF: the folder, the tokenizer, and
parity with llama.cpp on the same file.

Every number is onnxruntime on the CPU with one thread against llama.cpp's own
logits of the GGUF (``quantroute.quality.profiler``'s runner, as ``quantroute
profile`` gets them), scored like the profiler: chunks of 512 calibration tokens
from an empty cache, BOS first, the second half's next-token distributions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from qrtest import demo_model_dir
from quantroute.demo.model import ModelConfig
from quantroute.demo.onnx_export import DEMO_ONNX_BRANCHES, GgufSource, export_onnx
from quantroute.demo.vocab import VOCAB
from quantroute.divergence import kl_divergence, log_softmax, top1_agreement
from quantroute.engines.onnx.decoder_graph import halves_from_pairs
from quantroute.engines.onnx.layout import (
    LOGITS_TO_KEEP,
    MODEL_FILE,
    ONNX_PRECISIONS,
    TOKENIZER_FILE,
    DecoderConfig,
    input_names,
    kv_dtype,
    onnx_precision,
    output_names,
)
from quantroute.types import Precision

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("llama_cpp")

N_CTX = 512
FIRST = N_CTX // 2
N_CHUNKS = 8  # 2,040 scored tokens
ALL = (Precision.F32, Precision.F16, Precision.INT8, Precision.INT4)
Logits = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def f16() -> Path:
    return demo_model_dir() / "f16.gguf"


@pytest.fixture(scope="module")
def exported(f16: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[Precision, Path]:
    out = tmp_path_factory.mktemp("onnx")
    source = GgufSource.read(f16)
    for precision in ALL:
        export_onnx(source, out / f"onnx_{precision}", precision)
    return {p: out / f"onnx_{p}" for p in ALL}


class Decoder:
    """One exported folder in an onnxruntime CPU session with one thread."""

    def __init__(self, folder: Path) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 3  # not the warning that logits_to_keep is overridable
        self.config = DecoderConfig.read(folder)
        self.session = ort.InferenceSession(
            str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        self.outputs = output_names(self.config.n_layer)

    def step(
        self,
        ids: npt.NDArray[np.int64],
        mask: npt.NDArray[np.int64],
        past: dict[str, Any] | None = None,
        **extra: Any,
    ) -> tuple[Logits, dict[str, Any]]:
        """Feed ``ids`` ``[B, T]`` after ``past``; ``mask`` covers past and new ``[B, P+T]``.

        Positions count the tokens each row has (left padding takes none).
        """
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        feeds.update(self.config.empty_past(len(ids)) if past is None else past)
        feeds.update(extra)
        logits, *presents = self.session.run(self.outputs, feeds)
        names = input_names(self.config.n_layer)[3:]
        return logits, dict(zip(names, presents, strict=True))

    def chunk_rows(self, chunk: npt.NDArray[np.int32]) -> Logits:
        """The scored rows of one calibration chunk: ``[N_CTX - 1 - FIRST, V]``."""
        ids = chunk[None].astype(np.int64)
        logits, _ = self.step(ids, np.ones_like(ids))
        return logits[0, FIRST : N_CTX - 1]


def llama_rows(gguf: Path, chunks: list[npt.NDArray[np.int32]]) -> Logits:
    from quantroute.quality.profiler import _LlamaRunner

    rows = []
    with _LlamaRunner(gguf, n_ctx=N_CTX, n_threads=1) as llm:
        for chunk in chunks:
            llm.clear()
            rows.append(llm.decode(chunk.tolist(), pos0=0, rows=(FIRST, N_CTX - 1)))
    return np.concatenate(rows)  # [n_chunks * scored, V]


@pytest.fixture(scope="module")
def chunks(f16: Path) -> list[npt.NDArray[np.int32]]:
    from quantroute.quality.profiler import _LlamaRunner, default_calibration_text

    with _LlamaRunner(f16, vocab_only=True) as vocab:
        tokens = vocab.tokenize(default_calibration_text())
        out = []
        for i in range(N_CHUNKS):
            chunk = tokens[i * N_CTX : (i + 1) * N_CTX].copy()
            chunk[0] = vocab.bos
            out.append(chunk)
    return out


@pytest.fixture(scope="module")
def reference(f16: Path, chunks: list[npt.NDArray[np.int32]]) -> npt.NDArray[np.float64]:
    return log_softmax(llama_rows(f16, chunks))


@pytest.fixture(scope="module")
def kld_of(
    exported: dict[Precision, Path],
    chunks: list[npt.NDArray[np.int32]],
    reference: npt.NDArray[np.float64],
) -> Callable[[Precision], tuple[float, float]]:
    """Mean KLD against llama.cpp's F16 and top-1 agreement of one precision (cached)."""
    measured: dict[Precision, tuple[float, float]] = {}

    def measure(precision: Precision) -> tuple[float, float]:
        if precision not in measured:
            decoder = Decoder(exported[precision])
            q = log_softmax(np.concatenate([decoder.chunk_rows(c) for c in chunks]))
            kld = float(kl_divergence(reference, q).mean())
            measured[precision] = kld, float(top1_agreement(reference, q).mean())
        return measured[precision]

    return measure


# ---- pure parts ----------------------------------------------------------------------------------


def _rotate_pairs(x: Logits, cos: Logits, sin: Logits) -> Logits:
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out: Logits = np.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), axis=-1).reshape(x.shape)
    return out


def _rotate_halves(x: Logits, cos: Logits, sin: Logits) -> Logits:
    x1, x2 = np.split(x, 2, axis=-1)
    out: Logits = np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    return out


@pytest.mark.parametrize(("n_heads", "head_dim"), [(1, 2), (4, 8), (2, 64)])
def test_reordered_rows_rotated_by_halves_give_llama_cpps_scores(
    n_heads: int, head_dim: int
) -> None:
    """q·k per head is the same, to the bit, after reordering both and rotating halves."""
    rng = np.random.default_rng(0)
    d_in, half = 16, head_dim // 2
    wq = rng.standard_normal((n_heads * head_dim, d_in)).astype(np.float32)
    wk = rng.standard_normal((n_heads * head_dim, d_in)).astype(np.float32)
    x = rng.standard_normal((5, d_in)).astype(np.float32)
    angles = np.arange(5)[:, None] * 10000.0 ** (-np.arange(half) * 2 / head_dim)
    cos, sin = (
        np.cos(angles).astype(np.float32)[:, None],
        np.sin(angles).astype(np.float32)[:, None],
    )

    def scores(q: Logits, k: Logits) -> Logits:  # [5, H*hd] each -> [H, 5, 5]
        qh = q.reshape(5, n_heads, head_dim).transpose(1, 0, 2)
        kh = k.reshape(5, n_heads, head_dim).transpose(1, 0, 2)
        return np.asarray(qh @ kh.transpose(0, 2, 1))

    def heads(y: Logits) -> Logits:
        return y.reshape(5, n_heads, head_dim)

    ggml = scores(
        _rotate_pairs(heads(x @ wq.T), cos, sin).reshape(5, -1),
        _rotate_pairs(heads(x @ wk.T), cos, sin).reshape(5, -1),
    )
    ours = scores(
        _rotate_halves(heads(x @ halves_from_pairs(wq, n_heads).T), cos, sin).reshape(5, -1),
        _rotate_halves(heads(x @ halves_from_pairs(wk, n_heads).T), cos, sin).reshape(5, -1),
    )
    np.testing.assert_allclose(ours, ggml, rtol=1e-5, atol=1e-5)
    assert halves_from_pairs(np.arange(8.0, dtype=np.float32)[:, None], 1)[:, 0].tolist() == [
        0, 2, 4, 6, 1, 3, 5, 7,
    ]  # fmt: skip


def test_config_json_round_trips(f16: Path) -> None:
    config = GgufSource.read(f16).decoder_config(Precision.INT4)
    data = json.loads(json.dumps(config.to_json()))
    assert DecoderConfig.from_json(data) == config
    assert data["num_key_value_heads"] == 4 and data["quantroute"]["kv_dtype"] == "float32"
    assert kv_dtype(Precision.F16) == np.float16 and set(ALL) == ONNX_PRECISIONS


@pytest.mark.parametrize(
    ("given", "precision"),
    [("fp16", Precision.F16), ("f16", Precision.F16), ("fp32", Precision.F32),
     (Precision.INT4, Precision.INT4), ("int8", Precision.INT8)],
)  # fmt: skip
def test_precisions_are_read_in_either_spelling(given: str, precision: Precision) -> None:
    assert onnx_precision(given) is precision


@pytest.mark.parametrize("given", ["q4_k_m", "bf16", "int3", ""])
def test_a_precision_without_an_onnx_graph_is_refused(given: str) -> None:
    with pytest.raises(ValueError):
        onnx_precision(given)


# ---- the exported folders ------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ALL)
def test_the_folder_holds_the_graph_the_layout_promises(
    exported: dict[Precision, Path], precision: Precision
) -> None:
    folder = exported[precision]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", MODEL_FILE, TOKENIZER_FILE]
    config = DecoderConfig.read(folder)
    assert (config.n_layer, config.n_kv_heads, config.head_dim, config.n_vocab) == (2, 4, 64, 354)
    assert (config.bos_id, config.eos_id, config.n_ctx_train, config.precision) == (
        1, 2, 512, precision,
    )  # fmt: skip
    session = Decoder(folder).session
    kv = "tensor(float16)" if precision is Precision.F16 else "tensor(float)"
    inputs = {i.name: (i.type, i.shape) for i in session.get_inputs()}
    assert list(inputs) == input_names(2)
    assert inputs["input_ids"] == ("tensor(int64)", ["batch_size", "sequence_length"])
    assert inputs["attention_mask"] == ("tensor(int64)", ["batch_size", "total_sequence_length"])
    assert inputs["past_key_values.1.value"] == (kv, ["batch_size", 4, "past_sequence_length", 64])
    outputs = {o.name: (o.type, o.shape) for o in session.get_outputs()}
    assert list(outputs) == output_names(2)
    assert outputs["logits"] == ("tensor(float)", ["batch_size", "logits_length", 354])
    assert [i.name for i in session.get_overridable_initializers()] == [LOGITS_TO_KEEP]
    assert outputs["present.0.key"] == (kv, ["batch_size", 4, "total_sequence_length", 64])


def test_an_export_is_the_same_bytes_every_time(
    f16: Path, exported: dict[Precision, Path], tmp_path: Path
) -> None:
    for precision in (Precision.F16, Precision.INT4):
        again = tmp_path / str(precision)
        export_onnx(f16, again, precision)
        for name in ("config.json", MODEL_FILE, TOKENIZER_FILE):
            assert _sha(again / name) == _sha(exported[precision] / name), (precision, name)


def test_sizes_shrink_with_the_precision(exported: dict[Precision, Path]) -> None:
    sizes = [(exported[p] / MODEL_FILE).stat().st_size for p in ALL]
    assert sizes == sorted(sizes, reverse=True), sizes
    assert list(DEMO_ONNX_BRANCHES.values()) == [
        Precision.F16,
        Precision.INT8,
        Precision.INT4,
    ]


def test_external_data_gives_the_same_logits(
    f16: Path, exported: dict[Precision, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "external"
    export_onnx(f16, folder, Precision.F32, external_data=True)
    assert (
        (folder / MODEL_FILE).stat().st_size < 100_000 < (folder / "model.onnx.data").stat().st_size
    )
    ids = np.array([VOCAB.encode("def main():\n    return 0")], dtype=np.int64)
    a, _ = Decoder(folder).step(ids, np.ones_like(ids))
    b, _ = Decoder(exported[Precision.F32]).step(ids, np.ones_like(ids))
    np.testing.assert_array_equal(a, b)


def test_the_tokenizer_is_the_ggufs_own(f16: Path, exported: dict[Precision, Path]) -> None:
    import gguf

    from quantroute.quality.profiler import _LlamaRunner, default_calibration_text

    vocab_file = exported[Precision.INT8] / TOKENIZER_FILE
    assert vocab_file.stat().st_size < 64_000  # metadata only
    reader, source = gguf.GGUFReader(vocab_file), gguf.GGUFReader(f16)
    assert len(reader.tensors) == 0
    assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in source.fields.items() if not k.startswith("GGUF.")
    }
    text = default_calibration_text() + "\u2581 \u00e9\U0001f600 <s></s>"
    with (
        _LlamaRunner(vocab_file, vocab_only=True) as ours,
        _LlamaRunner(f16, vocab_only=True) as ref,
    ):
        np.testing.assert_array_equal(ours.tokenize(text), ref.tokenize(text))
        assert (ours.n_vocab, ours.bos, ours.add_bos) == (ref.n_vocab, ref.bos, ref.add_bos)


# ---- parity with llama.cpp -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("precision", [Precision.F32, Precision.F16])
def test_fp32_and_fp16_match_llama_cpp_on_the_f16_gguf(
    kld_of: Callable[[Precision], tuple[float, float]], precision: Precision
) -> None:
    """Measured: fp32 1.1e-6, fp16 7.7e-7 nats (fp16 rounds activations as ggml does)."""
    kld, top1 = kld_of(precision)
    assert kld < 1e-5, kld
    assert top1 > 0.999, top1


@pytest.mark.slow
def test_kld_grows_fp16_int8_int4_like_q8_0_and_q4_k_m(
    kld_of: Callable[[Precision], tuple[float, float]],
    demo_gguf_kld: Callable[[str], float],
) -> None:
    """Measured on these chunks: fp16 7.7e-7 < int8 2.3e-4 < int4 9.0e-3 nats; llama.cpp's
    q8_0 2.6e-4 and q4_k_m 1.3e-2 (int8 and int4 quantize activations in blocks, as ggml)."""
    fp16, int8, int4 = (kld_of(p)[0] for p in DEMO_ONNX_BRANCHES.values())
    assert fp16 < int8 < int4
    assert int8 < 2 * demo_gguf_kld("q8_0")  # the league of llama.cpp's at the same bits
    assert int4 < 2 * demo_gguf_kld("q4_k_m")


@pytest.fixture(scope="module")
def demo_gguf_kld(
    f16: Path, chunks: list[npt.NDArray[np.int32]], reference: npt.NDArray[np.float64]
) -> Callable[[str], float]:
    def measure(branch: str) -> float:
        q = log_softmax(llama_rows(f16.parent / f"{branch}.gguf", chunks))
        return float(kl_divergence(reference, q).mean())

    return measure


# ---- batches -------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ALL)
def test_a_left_padded_batch_decodes_as_each_prompt_alone(
    exported: dict[Precision, Path], precision: Precision
) -> None:
    """Prefill two prompts of different lengths together, then three greedy steps:
    every real row's logits are those of the prompt run by itself (within 1e-4)."""
    decoder = Decoder(exported[precision])
    prompts = [VOCAB.encode("import os\nimport sys\n\ndef main(argv):\n"), VOCAB.encode("x = [")]
    width = max(map(len, prompts))
    ids = np.full((2, width), VOCAB.size - 1, dtype=np.int64)  # any token: padding is masked
    mask = np.zeros((2, width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    logits, past = decoder.step(ids, mask)
    batch_rows = [[logits[r, width - len(p) :]] for r, p in enumerate(prompts)]
    fed: list[list[int]] = [[], []]
    for _ in range(3):
        nxt = logits[:, -1].argmax(axis=-1)[:, None].astype(np.int64)  # [2, 1]
        mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
        logits, past = decoder.step(nxt, mask, past)
        for r in range(2):
            fed[r].append(int(nxt[r, 0]))
            batch_rows[r].append(logits[r])
    for r, prompt in enumerate(prompts):
        ids = np.array([prompt], dtype=np.int64)
        alone, past_alone = decoder.step(ids, np.ones_like(ids))
        rows = [alone[0]]
        for k, token in enumerate(fed[r]):
            mask_alone = np.ones((1, len(prompt) + k + 1), dtype=np.int64)
            alone, past_alone = decoder.step(np.array([[token]]), mask_alone, past_alone)
            rows.append(alone[0])
        for got, want in zip(batch_rows[r], rows, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("precision", [Precision.F32, Precision.INT4])
def test_logits_to_keep_computes_only_the_last_rows(
    exported: dict[Precision, Path], precision: Precision
) -> None:
    decoder = Decoder(exported[precision])
    ids = np.array([VOCAB.encode("for i in range(10):\n    print(i)")], dtype=np.int64)
    every, past = decoder.step(ids, np.ones_like(ids))
    for keep, rows in [(1, 1), (3, 3), (0, ids.shape[1]), (10_000, ids.shape[1])]:
        kept, past_kept = decoder.step(ids, np.ones_like(ids), logits_to_keep=np.array(keep))
        assert kept.shape == (1, rows, VOCAB.size)
        np.testing.assert_allclose(kept, every[:, -rows:], rtol=0, atol=1e-5)
        for name, value in past.items():  # the cache is the whole prompt's either way
            np.testing.assert_array_equal(past_kept[name], value)


# ---- other shapes: grouped-query attention, a tied output head -----------------------------------


def _write_random_gguf(path: Path, config: ModelConfig, *, tied: bool) -> None:
    """A llama GGUF (F16 matrices) of random weights; without ``output.weight`` if ``tied``."""
    import gguf

    from quantroute.demo.model import param_shapes

    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_ff)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    VOCAB.add_to_gguf(writer)
    for name, shape in param_shapes(config).items():
        if tied and name == "output.weight":
            continue
        if len(shape) == 1:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            writer.add_tensor(name, (0.08 * rng.standard_normal(shape)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_grouped_query_attention_matches_llama_cpp(tmp_path: Path, tied: bool) -> None:
    config = ModelConfig(n_embd=128, n_layer=2, n_head=8, n_head_kv=2, n_ff=256, context_length=64)
    gguf_path = tmp_path / "gqa.gguf"
    _write_random_gguf(gguf_path, config, tied=tied)
    decoded = export_onnx(gguf_path, tmp_path / "onnx", Precision.F32)
    assert (decoded.n_kv_heads, decoded.tied_embeddings) == (2, tied)
    tokens = np.random.default_rng(1).integers(3, VOCAB.size, size=48).astype(np.int32)
    tokens[0] = 1
    from quantroute.quality.profiler import _LlamaRunner

    with _LlamaRunner(gguf_path, n_ctx=64, n_threads=1) as llm:
        ref = llm.decode(tokens.tolist(), pos0=0, rows=(0, len(tokens)))  # [48, V]
    ids = tokens[None].astype(np.int64)
    ours, _ = Decoder(tmp_path / "onnx").step(ids, np.ones_like(ids))
    kld = kl_divergence(log_softmax(ref), log_softmax(ours[0]))
    assert float(kld.mean()) < 1e-5, float(kld.mean())
    assert float(np.std(ref)) > 0.5  # the random model says something: not a flat distribution


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

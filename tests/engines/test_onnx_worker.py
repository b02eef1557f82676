"""ONNX Runtime branches: the llama.cpp worker with another forward pass
(``engines/onnx/worker_model.py``), on folders exported from the demo's F16 GGUF and
served through ``LlamaCppEngine(..., WorkerOptions(backend="onnx"), tokenizer=...)``.

The reference is the GGUF f16 branch on llama.cpp. The fp32 and fp16 folders compute
the same function of the same weights (mean KLD ~1e-6 nats against it,
tests/demo/test_onnx_export.py), so greedy text is the same but at near-ties, logprobs
agree to rounding, and a drift replay finds no divergence to speak of.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from hostile import rewrite_in_place
from qrtest import demo_model_dir
from quantroute.engines.base import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import ContextLengthExceededError
from quantroute.quality.metrics import kl_divergence, log_softmax

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from quantroute.demo.onnx_export import GgufSource, export_onnx
from quantroute.engines.llamacpp.sampler_chain import SamplerChain
from quantroute.engines.llamacpp.worker_model import Model
from quantroute.engines.onnx.layout import MODEL_FILE, TOKENIZER_FILE
from quantroute.engines.onnx.worker_model import OnnxModel, _calls
from quantroute.engines.sampling import Penalties
from quantroute.registry.digests import identity
from quantroute.registry.manifest import sha256_file
from quantroute.registry.verified import VerifiedFile
from quantroute.shaping.grammar import json_object_grammar

SHARED_LOOP = pytest.mark.asyncio(loop_scope="module")  # the module's engines live on it

N_CTX = 512
PROMPTS = (
    "def ",
    "import os\n\ndef ",
    "class Parser:\n    def __init__(self",
    "for i in range(",
    "# sort a list\n",
)
POLICY = RestartPolicy(backoff_s=0.1, backoff_max_s=0.5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 and fp16 folders exported from the demo's F16 GGUF."""
    out = tmp_path_factory.mktemp("onnx")
    source = GgufSource.read(demo_model_dir() / "f16.gguf")
    for precision in ("fp32", "fp16"):
        export_onnx(source, out / f"onnx_{precision}", precision)
    return {p: out / f"onnx_{p}" for p in ("fp32", "fp16")}


def _onnx(folder: Path, **options: Any) -> LlamaCppEngine:
    knobs = {"backend": "onnx", "parallel": 2, "n_threads": 1, "n_ctx": N_CTX} | options
    return LlamaCppEngine(
        f"tiny-llama:{folder.name}",
        folder / MODEL_FILE,
        WorkerOptions(**knobs),
        POLICY,
        tokenizer=folder / TOKENIZER_FILE,
    )


def _gguf(branch: str = "f16") -> LlamaCppEngine:
    options = WorkerOptions(parallel=2, n_threads=1, n_ctx=N_CTX)
    return LlamaCppEngine(
        f"tiny-llama:{branch}", demo_model_dir() / f"{branch}.gguf", options, POLICY
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(folders: dict[str, Path]) -> AsyncIterator[dict[str, LlamaCppEngine]]:
    """The fp32 and fp16 folders and the GGUF f16 reference: two slots of 512 cells each."""
    engines = {"fp32": _onnx(folders["fp32"]), "fp16": _onnx(folders["fp16"]), "gguf": _gguf()}
    try:
        await asyncio.gather(*(e.start() for e in engines.values()))
        assert all(e.ready for e in engines.values()), {n: e.failure for n, e in engines.items()}
        yield engines
    finally:
        await asyncio.gather(*(e.stop() for e in engines.values()))


@dataclass
class Result:
    start: StartEvent | None = None
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None
    stamps: list[float] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def text(self) -> str:
        tail = self.finish.text if self.finish is not None else ""
        return "".join(t.text for t in self.tokens) + tail


async def _run(engine: LlamaCppEngine, prompt: str = "def ", **sampling: Any) -> Result:
    params = {"max_tokens": 32, "temperature": 0.0} | sampling
    result = Result()
    async for ev in engine.generate(GenerationRequest("t", prompt, SamplingParams(**params))):
        if isinstance(ev, StartEvent):
            result.start = ev
        elif isinstance(ev, TokenEvent):
            result.tokens.append(ev)
            result.stamps.append(time.perf_counter())
        else:
            result.finish = ev
    assert result.finish is not None
    return result


def _common(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# ---- the model itself, in this process ----------------------------------------------------------


@pytest.fixture(scope="module")
def model(folders: dict[str, Path]) -> OnnxModel:
    folder = folders["fp32"]
    return OnnxModel(str(folder / MODEL_FILE), str(folder / TOKENIZER_FILE), n_ctx=64, parallel=3)


def _feed(model: OnnxModel, work: list[tuple[int, list[int], int]]) -> int:
    """Put ``(slot, tokens, first position)`` entries, every one asking for its row; decode."""
    i = 0
    for slot, tokens, pos in work:
        for j, token in enumerate(tokens):
            model.put(i, token, pos + j, slot, True)
            i += 1
    return model.decode(i)


def test_the_vocabulary_is_the_tokenizer_ggufs(model: OnnxModel) -> None:
    info = model.info()
    assert (info.n_vocab, info.n_ctx, info.n_ctx_train, info.parallel) == (354, 64, 512, 3)
    assert (info.bos_token, info.eos_token) == ("<s>", "</s>") and model.eog_tokens == [2]
    assert model.tokenize("def ", False) == [1, *(ord(c) + 227 for c in "def ")]  # byte-level
    assert model.piece(ord("d") + 227) == "d" and model.is_eog(2)
    assert (model.shape.n_layer, model.shape.n_kv_heads, model.shape.head_dim) == (2, 4, 64)


def test_a_batch_of_slots_gives_each_slot_its_own_rows(model: OnnxModel) -> None:
    """Three slots in one decode (a prompt, a longer one, a single token after a past) give
    the rows each gives decoded alone, in batch order; then every slot goes on."""
    a, b, c = model.tokenize("def f(x):", False), model.tokenize("import", False), [300]
    for slot in range(3):
        model.clear(slot)
    assert _feed(model, [(2, model.tokenize("x = ", False), 0)]) == 0  # slot 2 has a past
    assert _feed(model, [(0, a, 0), (1, b, 0), (2, c, 5)]) == 0
    together = model.rows(len(a) + len(b) + 1)[0].copy()  # [n, V]
    assert together.shape == (len(a) + len(b) + 1, 354)
    alone = []
    for slot, tokens, pos in ((0, a, 0), (1, b, 0), (2, c, 5)):
        model.keep_prefix(slot, pos)
        assert _feed(model, [(slot, tokens, pos)]) == 0
        alone.append(model.rows(len(tokens))[0].copy())
    np.testing.assert_allclose(together, np.concatenate(alone), rtol=0, atol=1e-4)
    assert np.array_equal(model.row(0), alone[2][0])  # the last decode's one row
    assert _feed(model, [(0, [301], len(a)), (1, [302], len(b)), (2, [303], 6)]) == 0
    assert model.rows(3)[0].shape == (3, 354)


def test_a_slot_without_room_or_out_of_order_entries_fail_the_decode_in_words(
    model: OnnxModel,
) -> None:
    model.clear(0)
    assert _feed(model, [(0, [300] * 60, 0)]) == 0
    assert _feed(model, [(0, [300] * 5, 60)]) == 1  # 65 cells > n_ctx 64: llama.cpp's status
    assert "slot 0 has no room" in model.decode_failure(1)
    assert _feed(model, [(0, [300], 10)]) == -1  # the slot holds 60 cells, not 10
    assert "do not continue its 60 cells" in model.decode_failure(-1)
    model.keep_prefix(0, 10)  # the prompt cache keeps a prefix: position 10 comes next
    assert _feed(model, [(0, [300], 10)]) == 0


def test_only_the_rows_asked_for_are_kept(model: OnnxModel) -> None:
    model.clear(0)
    for i, token in enumerate(model.tokenize("abc", False)):
        model.put(i, token, i, 0, i == 3)
    assert model.decode(4) == 0
    assert model.rows(1)[0].shape == (1, 354) and model.row(3).shape == (354,)
    with pytest.raises(IndexError):
        model.row(1)
    assert model._keeps_rows  # the export's graph computed that one row alone
    last = model.row(3).copy()
    model.clear(0)
    assert _feed(model, [(0, model.tokenize("abc", False), 0)]) == 0  # every row
    np.testing.assert_allclose(model.row(3), last, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("lengths", "calls"),
    [
        ([1, 1, 1], [[0, 1, 2]]),  # decoding only: one call
        ([40], [[0]]),  # a prompt alone
        ([1, 3], [[0, 1]]),  # a short prompt beside a token: padding costs little
        ([1, 1, 1, 100], [[0, 1, 2], [3]]),  # a long one: the tokens run apart
        ([30, 20, 1], [[0, 1, 2]]),  # 90 rows for 51: padded, but not twice over
        ([1, 1, 40, 30], [[0, 1], [2, 3]]),  # 160 for 72: the two prompts pad each other
    ],
)
def test_a_step_pads_its_slots_into_one_call_unless_padding_doubles_it(
    lengths: list[int], calls: list[list[int]]
) -> None:
    groups = [(slot, list(range(n))) for slot, n in enumerate(lengths)]
    got = _calls(groups, sum(lengths))
    assert [[slot for slot, _ in call] for call in got] == calls


def test_a_chain_draws_from_a_given_row_as_it_samples_from_llama_cpps() -> None:
    """``SamplerChain.draw`` (the ONNX model's ``sample``) over a row is the chain's
    ``sample`` over the same logits where llama.cpp holds them: the same token every step,
    seeded draws and penalties included, since each accepts what it picked."""
    llama = Model(str(demo_model_dir() / "f16.gguf"), n_ctx=256, parallel=1, n_threads=1)
    cases: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 7},
        {"temperature": 1.2, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "seed": 3},
        {"temperature": 0.8, "seed": 11, "penalties": Penalties(0.5, 0.3, 1.2)},
        {"temperature": 0.7, "seed": 5, "bias": {300: 3.0, 2: -5.0}},
    ]
    prompt = llama.tokenize("import os\n\ndef ", False)
    for case in cases:
        knobs = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None} | case
        knobs.setdefault("bias", {})
        knobs.setdefault("penalties", Penalties())

        def chain(knobs: dict[str, Any] = knobs) -> SamplerChain:
            return SamplerChain(n_vocab=llama.n_vocab, prompt=prompt, window=256, **knobs)

        sampled, drawn = chain(), chain()
        llama.clear(0)
        tokens, pos, picks = prompt, 0, []
        for _ in range(40):
            for j, token in enumerate(tokens):
                llama.put(j, token, pos + j, 0, j == len(tokens) - 1)
            assert llama.decode(len(tokens)) == 0
            pos += len(tokens)
            last = len(tokens) - 1
            want = llama.sample(sampled, last)  # llama.cpp's row, where it lies
            got = drawn.draw(llama.row(last).copy())
            assert got == want, (case, len(picks))
            picks.append(got)
            tokens = [got]
        sampled.close()
        drawn.close()
        assert len(set(picks)) > 1 or case["temperature"] == 0.0, case


# ---- through the engine --------------------------------------------------------------------------


@pytest.mark.slow
@SHARED_LOOP
async def test_info_says_what_the_worker_serves(
    served: dict[str, LlamaCppEngine], folders: dict[str, Path]
) -> None:
    info, ref = served["fp32"].info, served["gguf"].info
    assert info is not None and ref is not None
    assert (info.n_ctx, info.n_ctx_train, info.n_vocab, info.parallel) == (512, 512, 354, 2)
    assert (info.bos_token, info.eos_token, info.chat_template) == (
        ref.bos_token, ref.eos_token, ref.chat_template,
    )  # fmt: skip
    assert info.model_bytes == (folders["fp32"] / MODEL_FILE).stat().st_size
    assert info.pid == served["fp32"].pid


@pytest.mark.slow
@SHARED_LOOP
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
async def test_greedy_text_is_the_gguf_f16_branchs(
    served: dict[str, LlamaCppEngine], precision: str
) -> None:
    """64 greedy tokens of each prompt: the same as llama.cpp's on the F16 GGUF; where
    they part, it is at a near-tie of the reference's (its two best within 0.05 nats)."""
    agreed = 0
    for prompt in PROMPTS:
        ours = await _run(served[precision], prompt, max_tokens=64, ignore_eos=True)
        ref = await _run(served["gguf"], prompt, max_tokens=64, ignore_eos=True)
        k = _common(ours.ids, ref.ids)
        agreed += k
        if k < len(ref.ids):
            tie = await _run(
                served["gguf"], prompt, max_tokens=k + 1, ignore_eos=True, top_logprobs=2
            )
            (t1, _, lp1), (t2, _, lp2) = tie.tokens[k].top_logprobs
            assert {t1, t2} == {ours.ids[k], ref.ids[k]} and lp1 - lp2 < 0.05, (prompt, k)
    assert agreed >= 0.9 * 64 * len(PROMPTS), agreed


@pytest.mark.slow
@SHARED_LOOP
async def test_logprobs_are_llama_cpps_to_rounding(served: dict[str, LlamaCppEngine]) -> None:
    """Measured over 20 prompts x 64 tokens x top 5: |Δ logprob| p99 3.5e-3, max 1.1e-2 (on
    unlikely tokens); llama.cpp's own prefill and decode kernels differ by up to 1e-2."""
    prompt = "import os\n\ndef "
    ours = await _run(served["fp32"], prompt, max_tokens=24, logprobs=True, top_logprobs=3)
    ref = await _run(served["gguf"], prompt, max_tokens=24, logprobs=True, top_logprobs=3)
    k = _common(ours.ids, ref.ids)
    assert k >= 16
    for a, b in zip(ours.tokens[:k], ref.tokens[:k], strict=True):
        assert a.logprob is not None and b.logprob is not None and a.logprob <= 0
        assert a.top_logprobs[0][0] == a.token_id  # greedy: the most likely
        assert a.logprob == pytest.approx(b.logprob, abs=2e-2)
        assert a.piece == b.piece
        for (ta, pa, la), (tb, pb, lb) in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert la == pytest.approx(lb, abs=2e-2)
            assert (ta, pa) == (tb, pb) or abs(la - lb) < 2e-2  # a near-tie may swap


@pytest.mark.slow
@SHARED_LOOP
async def test_a_stream_starts_counts_stops_and_ends(served: dict[str, LlamaCppEngine]) -> None:
    engine = served["fp32"]
    events = [
        ev
        async for ev in engine.generate(
            GenerationRequest("t", "def ", SamplingParams(max_tokens=7, ignore_eos=True))
        )
    ]
    assert isinstance(events[0], StartEvent) and events[0].prompt_tokens == len("def ") + 1
    assert all(isinstance(ev, TokenEvent) for ev in events[1:-1]) and len(events) == 9
    fin = events[-1]
    assert isinstance(fin, FinishEvent) and fin.reason is FinishReason.LENGTH
    assert fin.completion_tokens == 7
    full = await _run(engine, "class ", max_tokens=80, ignore_eos=True)
    stop = full.text[10:13]
    cut = await _run(engine, "class ", max_tokens=80, ignore_eos=True, stop=(stop,))
    assert cut.finish is not None and cut.finish.reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


@pytest.mark.slow
@SHARED_LOOP
async def test_seeded_sampling_repeats_and_follows_llama_cpps_draws(
    served: dict[str, LlamaCppEngine],
) -> None:
    """The chain draws as it does on llama.cpp's logits: a seed repeats, another differs,
    and the same seed on the GGUF f16 branch draws the same tokens while the logits agree."""
    knobs = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 48, "ignore_eos": True}
    knobs |= {"repetition_penalty": 1.1, "frequency_penalty": 0.2}
    runs = [await _run(served["fp32"], **knobs, seed=s) for s in (1, 1, 2)]
    assert runs[0].ids == runs[1].ids and runs[0].ids != runs[2].ids
    ref = await _run(served["gguf"], **knobs, seed=1)
    assert _common(runs[0].ids, ref.ids) >= 24, (runs[0].text, ref.text)


@pytest.mark.slow
@SHARED_LOOP
async def test_concurrent_sequences_are_batched_and_each_is_its_alone(
    served: dict[str, LlamaCppEngine],
) -> None:
    """Four requests on two slots (n > 1 is several such sequences): each one's greedy
    tokens are what it got alone, and the two running at once share decode steps."""
    engine = served["fp32"]
    prompts = PROMPTS[:4]
    alone = [await _run(engine, p, max_tokens=48, ignore_eos=True) for p in prompts]
    together = await asyncio.gather(
        *(_run(engine, p, max_tokens=48, ignore_eos=True) for p in prompts)
    )
    for one, many in zip(alone, together, strict=True):
        assert many.ids == one.ids and many.text == one.text
    first, second = together[0], together[1]
    assert max(first.stamps[0], second.stamps[0]) < min(first.stamps[-1], second.stamps[-1])
    sampled = {"temperature": 0.8, "seed": 5, "max_tokens": 32, "ignore_eos": True}
    pair = await asyncio.gather(*(_run(engine, "x = ", **sampled) for _ in range(2)))
    assert pair[0].ids == pair[1].ids == (await _run(engine, "x = ", **sampled)).ids


@pytest.mark.slow
@SHARED_LOOP
async def test_cancel_mid_stream_frees_the_slot(folders: dict[str, Path]) -> None:
    engine = _onnx(folders["fp32"], parallel=1, n_ctx=4096)  # one slot: a long generation
    await engine.start()
    try:
        assert engine.ready, engine.failure
        stream = engine.generate(
            GenerationRequest("t", "def ", SamplingParams(max_tokens=4000, ignore_eos=True))
        )
        seen = 0
        async for ev in stream:
            seen += isinstance(ev, TokenEvent)
            if seen == 5:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        # the only slot: the next request starts only once the cancelled one stopped
        nxt = await _run(engine, max_tokens=1)
        assert time.perf_counter() - t0 < 0.5 and nxt.ids
        assert engine.in_flight == 0
    finally:
        await engine.stop()


@pytest.mark.slow
@SHARED_LOOP
async def test_a_json_object_request_gives_the_gguf_branchs_json(
    served: dict[str, LlamaCppEngine],
) -> None:
    """``response_format: json_object``: llama.cpp's grammar sampler over the ONNX rows,
    with the tokenizer's own vocabulary; the output parses and is the reference's."""
    grammar = json_object_grammar()
    prompt = 'config = {"name": '
    ours = await _run(served["fp32"], prompt, max_tokens=64, grammar=grammar)
    ref = await _run(served["gguf"], prompt, max_tokens=64, grammar=grammar)
    assert isinstance(json.loads(ours.text), dict), ours.text
    assert ours.text == ref.text


@pytest.mark.slow
@SHARED_LOOP
async def test_drift_scores_against_the_gguf_f16_reference(
    served: dict[str, LlamaCppEngine], tmp_path: Path
) -> None:
    """The drift monitor's replay: the GGUF f16 branch writes the reference rows; each
    ONNX branch scores against them (KLD ~1e-6) and writes rows whose argmax is its own
    greedy text."""
    prompt = "def parse(text):\n"
    greedy = await _run(served["fp32"], prompt, max_tokens=24, ignore_eos=True)
    tokens = greedy.ids
    ref = await served["gguf"].write_logits(prompt, tokens, tmp_path / "ref.f32")
    p = log_softmax(np.fromfile(ref.path, dtype=np.float32).reshape(len(tokens), -1))
    for precision in ("fp32", "fp16"):
        engine = served[precision]
        scores = await engine.score(prompt, tokens, ref)
        assert scores.kld.shape == (24,) and scores.kld.max() < 1e-4, scores.kld
        mine = await engine.write_logits(prompt, tokens, tmp_path / f"{precision}.f32")
        rows = np.fromfile(mine.path, dtype=np.float32).reshape(24, ref.n_vocab)  # [T, V]
        q = log_softmax(rows)
        assert scores.kld == pytest.approx(kl_divergence(p, q), rel=1e-5, abs=1e-9)
        if precision == "fp32":
            assert [int(r.argmax()) for r in rows] == tokens
            assert scores.top1.all()
        self_scores = await engine.score(prompt, tokens, mine)
        assert self_scores.kld.max() < 1e-6 and self_scores.top1.all()


@pytest.mark.slow
@SHARED_LOOP
async def test_a_prompt_too_long_is_context_length_exceeded(
    served: dict[str, LlamaCppEngine],
) -> None:
    engine = served["fp32"]
    with pytest.raises(ContextLengthExceededError) as info:
        await _run(engine, "x" * 400, max_tokens=200)
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.n_ctx) == (401, 200, 512)
    with pytest.raises(ContextLengthExceededError, match="at least"):
        await _run(engine, "\x7f" * 100_000, max_tokens=4)  # refused by its size
    assert (await _run(engine, max_tokens=2, ignore_eos=True)).finish is not None


@pytest.mark.slow
@SHARED_LOOP
async def test_the_prompt_cache_reuses_a_prefix_and_changes_nothing(
    served: dict[str, LlamaCppEngine],
) -> None:
    engine = served["fp16"]
    prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3
    cold = await _run(engine, prefix + "x = 1", max_tokens=24, ignore_eos=True)
    warm = await _run(engine, prefix + "x = 1", max_tokens=24, ignore_eos=True)
    assert cold.start is not None and warm.start is not None
    assert warm.start.cached_tokens == cold.start.prompt_tokens - 1
    assert warm.ids == cold.ids


@pytest.mark.slow
@SHARED_LOOP
async def test_a_broken_model_onnx_fails_its_branch_in_words(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "onnx_broken"
    shutil.copytree(folders["fp32"], broken)
    (broken / MODEL_FILE).write_bytes(b"\x08\x07not a model" * 100)
    engine = _onnx(broken)
    await engine.start()  # returns: a bad file is the branch's failure, not the caller's
    try:
        assert not engine.ready
        for _ in range(100):
            if engine.failure:
                break
            await asyncio.sleep(0.1)
        failure = engine.failure
        assert failure is not None and "3 times in a row" in failure
        assert "onnxruntime could not load model.onnx" in failure, failure
    finally:
        await engine.stop()


def test_an_onnx_worker_needs_a_tokenizer(folders: dict[str, Path]) -> None:
    options = WorkerOptions(backend="onnx")
    with pytest.raises(ValueError, match="tokenizer"):
        LlamaCppEngine("x:onnx", folders["fp32"] / MODEL_FILE, options, POLICY)
    argv = options.argv(Path("/m/model.onnx"), Path("/m/tokenizer.gguf"))
    assert argv[argv.index("--backend") + 1] == "onnx"
    assert argv[argv.index("--tokenizer") + 1] == "/m/tokenizer.gguf"
    assert "--backend" not in WorkerOptions().argv(Path("/m/a.gguf"))


def _verified(path: Path, label: str) -> VerifiedFile:
    return VerifiedFile(path, label, sha256_file(path), identity(os.stat(path)), settled=False)


@pytest.mark.slow
@SHARED_LOOP
async def test_the_worker_loads_the_verified_model_and_tokenizer(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """Both files are opened and checked before each spawn and handed to the worker as
    descriptors; a tokenizer that changed since it was verified fails the branch, in words."""
    folder = tmp_path / "onnx_fp32"
    shutil.copytree(folders["fp32"], folder)
    model, tokenizer = folder / MODEL_FILE, folder / TOKENIZER_FILE
    engine = LlamaCppEngine(
        "tiny-llama:onnx_fp32",
        model,
        WorkerOptions(backend="onnx", parallel=1, n_threads=1, n_ctx=N_CTX),
        POLICY,
        verified=_verified(model, "onnx_fp32/model.onnx"),
        tokenizer=_verified(tokenizer, "onnx_fp32/tokenizer.gguf"),
    )
    await engine.start()
    try:
        assert engine.ready, engine.failure
        pid = engine.pid
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert {str(model), str(tokenizer)} <= links  # the descriptors it was handed
        assert (await _run(engine, max_tokens=4, ignore_eos=True)).finish is not None
        data = tokenizer.read_bytes()
        rewrite_in_place(tokenizer, data[:-1] + bytes([data[-1] ^ 1]))  # its size, its mtime
        moved = engine.file_moved()
        assert moved is not None and "onnx_fp32/tokenizer.gguf" in moved
        engine.refuse(moved)
        for _ in range(100):
            if engine.failure:
                break
            await asyncio.sleep(0.1)
        assert engine.failure is not None and "onnx_fp32/tokenizer.gguf" in engine.failure
    finally:
        with contextlib.suppress(Exception):
            await engine.stop()

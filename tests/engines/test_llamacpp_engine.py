"""The llama.cpp engine on the real demo model, in real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from qrtest import demo_model_dir
from quantroute.engines.base import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    ReferenceLogits,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.llamacpp import engine as llamacpp
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import ContextLengthExceededError, EngineCrashedError, EngineError
from quantroute.quality.metrics import kl_divergence, log_softmax, top1_agreement

pytestmark = pytest.mark.slow


async def _engine(branch: str = "q8_0", parallel: int = 4, n_ctx: int = 0) -> LlamaCppEngine:
    engine = LlamaCppEngine(
        f"tiny-llama:{branch}",
        demo_model_dir() / f"{branch}.gguf",
        WorkerOptions(parallel=parallel, n_threads=1, n_ctx=n_ctx),
        RestartPolicy(backoff_s=0.2, backoff_max_s=1.0),
    )
    await engine.start()
    assert engine.ready
    return engine


@pytest.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    e = await _engine()
    yield e
    await e.stop()


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _req(prompt: str = "def ", **sampling: object) -> GenerationRequest:
    params = {"max_tokens": 32, "temperature": 0.0} | sampling
    return GenerationRequest("t", prompt, SamplingParams(**params))  # type: ignore[arg-type]


async def _run(
    engine: LlamaCppEngine, req: GenerationRequest
) -> tuple[str, FinishEvent, list[float]]:
    text, stamps, finish = [], [], None
    async for ev in engine.generate(req):
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
            stamps.append(time.perf_counter())
        elif isinstance(ev, FinishEvent):
            text.append(ev.text)
            finish = ev
    assert finish is not None
    return "".join(text), finish, stamps


async def test_info_reports_the_model(engine: LlamaCppEngine) -> None:
    info = engine.info
    assert info is not None
    assert info.n_ctx == info.n_ctx_train == 512
    assert info.parallel == 4 and info.chat_template is None
    assert info.bos_token == "<s>" and info.eos_token == "</s>"


async def test_greedy_generation_is_deterministic_and_python_like(engine: LlamaCppEngine) -> None:
    a, fin_a, _ = await _run(engine, _req("import os\n\ndef ", max_tokens=64))
    b, fin_b, _ = await _run(engine, _req("import os\n\ndef ", max_tokens=64))
    assert a == b and fin_a.completion_tokens == fin_b.completion_tokens
    assert fin_a.prompt_tokens == len("import os\n\ndef ") + 1  # byte-level + BOS
    assert sum(c.isprintable() or c in "\n\t" for c in a) / max(len(a), 1) > 0.95


async def test_seeded_sampling_repeats_and_differs_by_seed(engine: LlamaCppEngine) -> None:
    runs = [
        await _run(engine, _req(temperature=0.9, seed=s, max_tokens=48, ignore_eos=True))
        for s in (1, 1, 2)
    ]
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] != runs[2][0]


async def test_max_tokens_and_stop_sequences(engine: LlamaCppEngine) -> None:
    _text, fin, _ = await _run(engine, _req(max_tokens=7, ignore_eos=True))
    assert fin.reason is FinishReason.LENGTH and fin.completion_tokens == 7
    full, _, _ = await _run(engine, _req("class ", max_tokens=80, ignore_eos=True))
    stop = full[10:13]
    cut, fin, _ = await _run(engine, _req("class ", max_tokens=80, ignore_eos=True, stop=(stop,)))
    assert fin.reason is FinishReason.STOP
    assert cut == full[: full.index(stop)]


async def test_logprobs_are_log_probabilities(engine: LlamaCppEngine) -> None:
    events = [ev async for ev in engine.generate(_req(max_tokens=5, logprobs=True, top_logprobs=3))]
    toks = [e for e in events if isinstance(e, TokenEvent)]
    assert toks and all(t.logprob is not None and t.logprob <= 0 for t in toks)
    for t in toks:  # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0][0] == t.token_id
        assert [lp for _, _, lp in t.top_logprobs] == sorted(
            (lp for _, _, lp in t.top_logprobs), reverse=True
        )


async def test_context_window_is_enforced_before_start(engine: LlamaCppEngine) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        async for _ in engine.generate(_req("x" * 400, max_tokens=200)):
            pass
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.n_ctx) == (401, 200, 512)


async def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing_it(
    engine: LlamaCppEngine,
) -> None:
    """llama.cpp's tokenizer took 100 s on a megabyte of one control character, holding
    every other sequence of the worker; a prompt longer in bytes than the context's worth of
    the longest token cannot fit, and is refused by its size at once."""
    started = time.monotonic()
    with pytest.raises(ContextLengthExceededError, match="at least") as info:
        await _run(engine, _req("\x7f" * (1 << 20), max_tokens=4))
    assert time.monotonic() - started < 5
    assert info.value.prompt_tokens > 512 - 4 and info.value.n_ctx == 512
    _text, fin, _ = await _run(engine, _req(max_tokens=2, ignore_eos=True))  # and it serves on
    assert fin.completion_tokens == 2


async def test_a_slow_prompt_is_tokenized_while_the_other_sequences_decode() -> None:
    """llama.cpp's tokenizer is quadratic on a long run of one character (200 KB of one
    takes about 1.5 s here); tokenized on the decode loop, such a prompt held every other
    sequence of the worker until it was done. It is tokenized on a thread of its own."""
    engine = await _engine(parallel=2, n_ctx=65536)  # 5-byte tokens at most: 320 KB may fit
    try:
        stamps: list[float] = []
        going = asyncio.Event()

        async def decode() -> None:
            async for ev in engine.generate(_req(max_tokens=60_000, ignore_eos=True)):
                if isinstance(ev, TokenEvent):
                    stamps.append(time.perf_counter())
                    if len(stamps) == 10:
                        going.set()

        decoding = asyncio.create_task(decode())
        await asyncio.wait_for(going.wait(), 30)
        started = time.perf_counter()
        with pytest.raises(ContextLengthExceededError) as info:  # tokenized: 200,001 tokens
            await _run(engine, _req("\x7f" * 200_000, max_tokens=1))
        took = time.perf_counter() - started
        assert info.value.prompt_tokens == 200_001 and "at least" not in str(info.value)
        during = [t for t in stamps if started <= t <= started + took]
        decoding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await decoding
        assert took > 0.5, took  # the tokenizer did take a while
        gaps = np.diff([started, *during, started + took])
        assert gaps.max() < min(0.25, took / 3), (took, gaps.max(), len(during))
    finally:
        await engine.stop()


async def test_a_short_prompt_is_not_held_behind_a_slow_one_being_tokenized() -> None:
    """A long prompt is tokenized on a thread of its own (engines/llamacpp/tokenizer.py): a short
    request that arrives while it is being tokenized is answered first. On one tokenizer
    thread it waited for all of the slow prompt's 1.5 s."""
    engine = await _engine(parallel=2, n_ctx=65536)
    try:
        started = time.perf_counter()
        slow = asyncio.create_task(_run(engine, _req("\x7f" * 200_000, max_tokens=1)))
        await asyncio.sleep(0.1)  # in the tokenizer by now
        text, finish, _ = await _run(engine, _req(max_tokens=4, ignore_eos=True))
        short_done = time.perf_counter() - started
        assert finish.completion_tokens == 4 and text
        assert not slow.done(), short_done  # answered while the slow prompt still tokenizes
        with pytest.raises(ContextLengthExceededError):
            await slow
        took = time.perf_counter() - started
        assert took > 0.5 and short_done < took / 2, (short_done, took)
    finally:
        await engine.stop()


async def test_concurrent_requests_are_batched_not_queued(engine: LlamaCppEngine) -> None:
    n_tokens = 200
    req = _req(max_tokens=n_tokens, ignore_eos=True)

    async def alone() -> float:
        t0 = time.perf_counter()
        await _run(engine, req)
        return time.perf_counter() - t0

    ratios = []
    for _ in range(3):  # a shared 2-core machine can stall any one try; queueing stalls all
        before = await alone()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_run(engine, req) for _ in range(4)))
        four = time.perf_counter() - t0
        one = (before + await alone()) / 2  # on both sides: this machine's speed drifts
        firsts = [stamps[0] for _, _, stamps in results]
        lasts = [stamps[-1] for _, _, stamps in results]
        # Every stream has started before any has finished: they share batches.
        assert max(firsts) < min(lasts)
        assert all(fin.completion_tokens == n_tokens for _, fin, _ in results)
        ratios.append(four / one)
        if ratios[-1] < 3.5:
            break
    # Queued one after another, four would take four times one at least, every time.
    assert min(ratios) < 3.5, ratios


async def test_cancel_frees_the_sequence_within_100ms() -> None:
    # 4000 tokens (past the demo's training context: noise, but seconds of decoding)
    engine = await _engine(parallel=1, n_ctx=4096)
    try:
        stream = engine.generate(_req(max_tokens=4000, ignore_eos=True))
        seen = 0
        async for ev in stream:
            seen += isinstance(ev, TokenEvent)
            if seen == 5:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        # With one slot, the next request can only start once the cancelled one stopped decoding.
        async for ev in engine.generate(_req(max_tokens=1)):
            if isinstance(ev, TokenEvent):
                break
        assert time.perf_counter() - t0 < 0.1
    finally:
        await engine.stop()


async def test_worker_killed_mid_stream_fails_cleanly_and_restarts(engine: LlamaCppEngine) -> None:
    pid = engine.pid
    assert pid is not None
    got = 0
    with pytest.raises(EngineCrashedError):
        async for ev in engine.generate(_req(max_tokens=450, ignore_eos=True)):
            if isinstance(ev, StartEvent):
                continue
            got += 1
            if got == 3:
                os.kill(pid, signal.SIGKILL)
    assert not engine.ready
    for _ in range(100):
        if engine.ready:
            break
        await asyncio.sleep(0.1)
    assert engine.ready and engine.pid not in (None, pid) and engine.restarts == 1
    _text, fin, _ = await _run(engine, _req(max_tokens=4, ignore_eos=True))
    assert fin.completion_tokens == 4


async def test_a_request_that_saw_its_worker_die_finds_the_branch_not_ready(
    engine: LlamaCppEngine,
) -> None:
    """Whichever notices first, the reader of the worker's output or the supervisor's
    wait for its exit, the branch is not ready once a request has failed for it."""
    on_exit = engine._supervisor._on_exit
    loop = asyncio.get_running_loop()
    engine._supervisor._on_exit = lambda code: loop.call_later(0.5, on_exit, code)  # type: ignore[method-assign]
    pid = engine.pid
    assert pid is not None
    with pytest.raises(EngineCrashedError):
        async for ev in engine.generate(_req(max_tokens=450, ignore_eos=True)):
            if isinstance(ev, TokenEvent):
                os.kill(pid, signal.SIGKILL)
    assert not engine.ready


async def test_a_worker_that_closes_its_output_but_never_exits_is_killed_and_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing such a worker does can reach a request again, and a process that never
    exits is never restarted by its exit: the engine kills it after a grace."""
    monkeypatch.setattr(llamacpp, "EXIT_GRACE_S", 0.5)
    engine = LlamaCppEngine(
        "tiny-llama:q8_0",
        demo_model_dir() / "q8_0.gguf",
        WorkerOptions(parallel=2, n_threads=1, fault="hang-up-at-decode"),
        RestartPolicy(backoff_s=0.1, backoff_max_s=0.5),
    )
    await engine.start()
    try:
        assert engine.ready  # the warm-up does not hang up
        pid = engine.pid
        with pytest.raises(EngineCrashedError, match="closed its output"):
            await _run(engine, _req(max_tokens=4))
        for _ in range(100):
            if engine.ready:
                break
            await asyncio.sleep(0.1)
        assert engine.ready and engine.pid not in (None, pid) and engine.restarts == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the wedged one is gone, not left behind
    finally:
        await engine.stop()


async def test_a_wedged_worker_is_replaced_though_every_caller_leaves_before_its_timeout() -> None:
    """The gateway's first-token timeout leaves a request before the engine's idle timeout
    would fire; a worker that answers nothing at all must be replaced all the same."""
    engine = LlamaCppEngine(
        "tiny-llama:q8_0",
        demo_model_dir() / "q8_0.gguf",
        WorkerOptions(parallel=2, n_threads=1, fault="hang-at-decode", gen_idle_timeout_s=1.0),
        RestartPolicy(backoff_s=0.1, backoff_max_s=0.5),
    )
    await engine.start()
    try:
        assert engine.ready
        pid = engine.pid

        async def leave_early() -> None:  # as the runner's first-token timeout does
            with contextlib.suppress(TimeoutError, EngineCrashedError):
                await asyncio.wait_for(_run(engine, _req(max_tokens=4)), 0.4)

        started = time.monotonic()
        while engine.pid == pid and time.monotonic() - started < 10:
            if engine.ready:
                await leave_early()
            else:
                await asyncio.sleep(0.05)
        assert engine.pid != pid, "the wedged worker was never replaced"
        for _ in range(100):
            if engine.ready:
                break
            await asyncio.sleep(0.1)
        assert engine.ready and engine.pid not in (None, pid) and engine.restarts == 1
    finally:
        await engine.stop()


async def test_a_broken_model_file_never_raises_and_fails_its_branch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    engine = LlamaCppEngine(
        "x:bad",
        bad,
        WorkerOptions(),
        RestartPolicy(backoff_s=0.05, backoff_max_s=0.1, max_crashes=3),
    )
    await engine.start()  # returns: a bad file is the branch's failure, not the caller's
    assert not engine.ready
    for _ in range(100):
        if engine.failure:
            break
        await asyncio.sleep(0.1)
    assert engine.failure is not None and "3 times in a row" in engine.failure
    assert engine.restarts == 2  # three tries, then it stays down
    await asyncio.sleep(0.3)
    assert engine.restarts == 2
    await engine.stop()


async def test_logits_reproduce_greedy_generation_and_score_against_themselves(
    engine: LlamaCppEngine, tmp_path: Path
) -> None:
    prompt = "def parse(text):\n"
    events = [
        e
        async for e in engine.generate(_req(prompt, max_tokens=24, logprobs=True, ignore_eos=True))
    ]
    toks = [e for e in events if isinstance(e, TokenEvent)]
    tokens = [t.token_id for t in toks]
    path = tmp_path / "ref.f32"
    ref = await engine.write_logits(prompt, tokens, path)
    assert (ref.path, ref.n_tokens, ref.n_vocab) == (path, 24, engine.info.n_vocab)  # type: ignore[union-attr]
    assert path.stat().st_size == ref.nbytes
    logits = np.fromfile(path, dtype=np.float32).reshape(24, ref.n_vocab)  # [T, V]
    assert [int(r.argmax()) for r in logits] == tokens
    rows = log_softmax(logits)
    for row, tok in zip(rows, toks, strict=True):
        # prefill and one-token decode use different kernels: close, not bit-equal
        assert row[tok.token_id] == pytest.approx(tok.logprob, abs=1e-2)
    scores = await engine.score(prompt, tokens, ref)  # the same branch: no divergence
    assert scores.kld.shape == (24,) and scores.top1.all()
    assert scores.kld.max() < 1e-9


async def test_a_quantized_branch_scores_against_the_reference_file(
    engine: LlamaCppEngine, tmp_path: Path
) -> None:
    """q8_0 (the fixture) against f16's logits: the worker's numbers are
    metrics.kl_divergence / top1_agreement over the two sets of rows."""
    reference = await _engine("f16", parallel=1)
    try:
        prompt, tokens = "import os\n", [ord(c) + 227 for c in "def main():"]
        ref = await reference.write_logits(prompt, tokens, tmp_path / "f16.f32")
        mine = await engine.write_logits(prompt, tokens, tmp_path / "q8.f32")
        scores = await engine.score(prompt, tokens, ref)
    finally:
        await reference.stop()
    p = log_softmax(np.fromfile(ref.path, dtype=np.float32).reshape(len(tokens), -1))
    q = log_softmax(np.fromfile(mine.path, dtype=np.float32).reshape(len(tokens), -1))
    assert scores.kld == pytest.approx(kl_divergence(p, q), rel=1e-6, abs=1e-12)
    assert (scores.top1 == top1_agreement(p, q)).all()
    assert 0 < scores.kld.mean() < 0.05


async def test_scoring_errors_fail_only_that_request(
    engine: LlamaCppEngine, tmp_path: Path
) -> None:
    path = tmp_path / "exists.f32"
    path.write_bytes(b"")
    with pytest.raises(EngineError, match="File exists"):  # never overwrites a file
        await engine.write_logits("x", [300, 301], path)
    assert path.read_bytes() == b""
    bogus = ReferenceLogits(tmp_path / "missing.f32", 2, engine.info.n_vocab)  # type: ignore[union-attr]
    with pytest.raises(EngineError, match="No such file"):
        await engine.score("x", [300, 301], bogus)
    ref = await engine.write_logits("x", [300, 301], tmp_path / "two.f32")
    with pytest.raises(EngineError, match="2 rows for 3 tokens"):
        await engine.score("x", [300, 301, 302], ref)
    wrong_vocab = ReferenceLogits(ref.path, 1, 2 * ref.n_vocab)
    with pytest.raises(EngineError, match="vocabulary"):
        await engine.score("x", [300], wrong_vocab)
    assert engine.ready and engine.restarts == 0
    _text, fin, _ = await _run(engine, _req(max_tokens=3, ignore_eos=True))
    assert fin.completion_tokens == 3


async def test_a_cancelled_logits_job_leaves_no_file(tmp_path: Path) -> None:
    engine = await _engine(parallel=1, n_ctx=4096)
    try:
        # A long generation holds the only sequence: the logits job waits (its file made),
        # and is cancelled while it does.
        long = asyncio.create_task(_run(engine, _req(max_tokens=3000, ignore_eos=True)))
        await asyncio.sleep(0.2)
        queued = asyncio.create_task(engine.write_logits("x", [300] * 64, tmp_path / "q.f32"))
        await asyncio.sleep(0.2)
        assert _listing(tmp_path) == ["q.f32"] and not long.done()
        queued.cancel()
        long.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long
        with contextlib.suppress(asyncio.CancelledError):
            await queued
        # Round trip: the worker handled both cancels before it answers this.
        _text, fin, _ = await _run(engine, _req(max_tokens=1, ignore_eos=True))
        assert fin.completion_tokens == 1
        assert _listing(tmp_path) == []
    finally:
        await engine.stop()

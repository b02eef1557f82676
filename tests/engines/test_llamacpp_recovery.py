"""The llama.cpp engine never hangs on its worker: a reader that dies (a line over the
pipe's limit), a worker that stops answering or stops reading, an event over the
worker's own line limit, a request queued too long. Real workers, the demo model."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from qrtest import demo_model_dir
from quantroute.engines.base import GenerationRequest, SamplingParams, TokenEvent
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import EngineCrashedError, EngineError, EngineUnavailableError

pytestmark = pytest.mark.slow

T = TypeVar("T")


async def _engine(**options: Any) -> LlamaCppEngine:
    opts = {"parallel": 4, "n_threads": 1} | options
    engine = LlamaCppEngine(
        "tiny-llama:q8_0",
        demo_model_dir() / "q8_0.gguf",
        WorkerOptions(**opts),
        RestartPolicy(backoff_s=0.1, backoff_max_s=0.5),
    )
    await engine.start()
    assert engine.ready
    return engine


def _req(max_tokens: int, prompt: str = "def ") -> GenerationRequest:
    return GenerationRequest(
        "t", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


async def _tokens(engine: LlamaCppEngine, req: GenerationRequest, started: asyncio.Event) -> int:
    n = 0
    async for ev in engine.generate(req):
        if isinstance(ev, TokenEvent):
            n += 1
            started.set()
    return n


async def _within(seconds: float, aw: Awaitable[T]) -> tuple[T | BaseException, float]:
    """The outcome of ``aw`` (a result or the error it raised) and how long it took; a
    hang fails the test."""
    t0 = time.perf_counter()
    try:
        result: T | BaseException = await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        pytest.fail(f"hung for {seconds}s")
    except Exception as exc:
        result = exc
    return result, time.perf_counter() - t0


async def _ready_again(engine: LlamaCppEngine, old_pid: int | None) -> None:
    for _ in range(200):
        if engine.ready and engine.pid not in (None, old_pid):
            return
        await asyncio.sleep(0.05)
    pytest.fail("the worker was not restarted")


async def test_an_oversize_line_kills_the_reader_and_the_branch_recovers(
    engines: list[LlamaCppEngine], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await _engine(
        fault="oversize-line", n_ctx=4096, gen_idle_timeout_s=20, score_timeout_s=20
    )
    engines.append(engine)
    pid = engine.pid
    started = [asyncio.Event(), asyncio.Event()]
    gens = [asyncio.create_task(_tokens(engine, _req(3000), s)) for s in started]
    await asyncio.gather(*(s.wait() for s in started))
    caplog.set_level(logging.WARNING, logger="quantroute.engines")
    # The worker answers this with a line over the gateway's 16 MiB limit.
    score = engine.write_logits("x", [300, 301], tmp_path / "ref.f32")
    outcomes = await asyncio.gather(*(_within(10, aw) for aw in (score, *gens)))
    # At once, not when the supervisor notices the exit: new requests are refused.
    with pytest.raises(EngineUnavailableError):
        await anext(aiter(engine.generate(_req(1))))
    for error, took in outcomes:  # the score and both streams: an error, promptly
        assert isinstance(error, EngineCrashedError), error
        assert "its output could not be read (ValueError" in str(error)
        assert took < 5

    await _ready_again(engine, pid)
    logged = [r.getMessage() for r in caplog.records]
    assert any("abandoning worker" in m and "ValueError" in m for m in logged), logged
    assert any("worker died (killed by the gateway: its output" in m for m in logged), logged
    assert engine.restarts == 1 and engine.failure is None
    n, _ = await _within(10, _tokens(engine, _req(5), asyncio.Event()))
    assert n == 5
    # Every fresh worker misbehaves on its first scoring command: each failure is its
    # own (the runs were healthy), so the branch restarts again rather than failing.
    pid = engine.pid
    error, _ = await _within(10, engine.write_logits("x", [300], tmp_path / "again.f32"))
    assert isinstance(error, EngineCrashedError)
    await _ready_again(engine, pid)
    assert engine.restarts == 2 and engine.failure is None


async def test_an_event_over_the_worker_line_limit_fails_only_its_request(
    engines: list[LlamaCppEngine], tmp_path: Path
) -> None:
    engine = await _engine(max_event_bytes=1024)
    engines.append(engine)
    pid = engine.pid
    tokens = [300 + i % 50 for i in range(400)]
    ref = await engine.write_logits("x", tokens, tmp_path / "ref.f32")  # a short answer
    started = asyncio.Event()
    gen = asyncio.create_task(_tokens(engine, _req(200), started))
    await started.wait()
    # 400 per-token results are ~3.6 kB: over 1024 bytes, so this request (only) fails.
    error, _ = await _within(10, engine.score("x", tokens, ref))
    assert isinstance(error, EngineError) and error.error_code == "event_too_large"
    assert "over its 1024-byte line limit" in error.message
    assert await asyncio.wait_for(gen, 10) == 200
    small = await engine.write_logits("x", tokens[:50], tmp_path / "small.f32")
    scores = await engine.score("x", tokens[:50], small)
    assert scores.kld.shape == (50,) and scores.top1.all()
    assert engine.ready and engine.pid == pid and engine.restarts == 0


async def test_a_stopped_worker_times_out_and_is_replaced(
    engines: list[LlamaCppEngine],
) -> None:
    engine = await _engine(n_ctx=4096, gen_idle_timeout_s=1.0, score_timeout_s=1.0)
    engines.append(engine)
    pid = engine.pid
    assert pid is not None
    started = [asyncio.Event(), asyncio.Event()]
    gens = [asyncio.create_task(_tokens(engine, _req(3000), s)) for s in started]
    await asyncio.gather(*(s.wait() for s in started))
    os.kill(pid, signal.SIGSTOP)  # alive, but silent: only a timeout can tell
    outcomes = await asyncio.gather(*(_within(10, g) for g in gens))
    for error, took in outcomes:
        assert isinstance(error, EngineError), error
        assert took < 3
    codes = {e.error_code for e, _ in outcomes if isinstance(e, EngineError)}
    assert "engine_timeout" in codes  # one timed out; the worker was abandoned for it
    await _ready_again(engine, pid)
    assert engine.restarts == 1


async def test_writes_respect_backpressure_and_time_out_on_a_full_pipe(
    engines: list[LlamaCppEngine],
) -> None:
    engine = await _engine(gen_idle_timeout_s=1.0)
    engines.append(engine)
    pid = engine.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # its stdin is no longer read: the pipe fills
    # 4 MB of prompt: far more than the pipe and the transport's buffer hold, so the
    # write waits in drain() (never an unbounded buffer), then gives up.
    error, took = await _within(10, _tokens(engine, _req(1, "x" * (4 << 20)), asyncio.Event()))
    assert isinstance(error, EngineError) and error.error_code == "engine_timeout"
    assert "took no command" in error.message
    assert 0.9 < took < 3
    await _ready_again(engine, pid)


async def test_a_request_queued_too_long_fails_alone(engines: list[LlamaCppEngine]) -> None:
    engine = await _engine(parallel=1, n_ctx=4096, gen_idle_timeout_s=0.5)
    engines.append(engine)
    pid = engine.pid
    started = asyncio.Event()
    first = asyncio.create_task(_tokens(engine, _req(4000), started))
    await started.wait()
    # The only sequence is busy for seconds; this one waits for it in vain.
    error, took = await _within(10, _tokens(engine, _req(4), asyncio.Event()))
    assert isinstance(error, EngineError) and error.error_code == "engine_timeout"
    assert 0.5 <= took < 2 and not first.done()
    assert await asyncio.wait_for(first, 60) == 4000  # the busy worker was not blamed
    assert engine.pid == pid and engine.restarts == 0

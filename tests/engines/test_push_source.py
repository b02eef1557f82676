"""A llama.cpp generation read as a push source (``Generation.take_ready``, ``notify``), and
a run that reads its streams that way: no pump task, and a stream's plain tokens rendered
into its stream store in the engine's own task. Real worker processes on the demo model."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from qrtest import demo_model_dir, fake_table
from quantroute.api.jobs import Job, build_job
from quantroute.api.render import ResponseRenderer
from quantroute.api.run import Run
from quantroute.api.schemas import CompletionRequest
from quantroute.api.sse import payloads, write_inline
from quantroute.config import StreamSettings
from quantroute.engines.base import (
    EngineEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.engine import Generation, LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import EngineCrashedError
from quantroute.resilience.resume import StreamStore
from quantroute.routing.policy import pinned
from quantroute.routing.table import Branch

pytestmark = pytest.mark.slow


@pytest.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    e = LlamaCppEngine(
        "tiny-llama:q8_0",
        demo_model_dir() / "q8_0.gguf",
        WorkerOptions(parallel=4, n_threads=1),
        RestartPolicy(backoff_s=0.2, backoff_max_s=1.0),
    )
    await e.start()
    assert e.ready
    yield e
    await e.stop()


def _request(max_tokens: int) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest("push", "def fib(n):", sampling)


async def _reference(engine: LlamaCppEngine, max_tokens: int) -> list[int]:
    """The greedy tokens of ``_request``, read one at a time."""
    events = [e async for e in engine.generate(_request(max_tokens))]
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


async def _opened(engine: LlamaCppEngine, max_tokens: int) -> tuple[Generation, list[EngineEvent]]:
    generation = engine.generate(_request(max_tokens))
    read = [await anext(generation), await anext(generation)]  # the start and first token
    assert isinstance(read[0], StartEvent) and isinstance(read[1], TokenEvent)
    return generation, read


async def _until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (the worker's pipe has no event for it)
            await asyncio.sleep(0.01)


async def test_a_generation_hands_out_what_came_and_says_when_more_comes(
    engine: LlamaCppEngine,
) -> None:
    reference = await _reference(engine, 48)
    generation, read = await _opened(engine, 48)
    came = asyncio.Event()
    told: list[int] = []

    def notify() -> None:
        told.append(1)
        came.set()

    generation.notify = notify
    events = list(read)
    while not isinstance(events[-1], FinishEvent):
        taken = generation.take_ready()
        if not taken:
            came.clear()
            await asyncio.wait_for(came.wait(), 10)
        events.extend(taken)
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == reference  # the same greedy text as read one at a time
    assert told  # it was told, in the engine's task, rather than waiting on the inbox
    assert events[-1].completion_tokens == 48
    assert generation.take_ready() == [] and not generation.has_ready()
    assert engine.in_flight == 0  # over: forgotten, nothing owed


async def test_tokens_only_stops_before_the_end_and_leaves_it(engine: LlamaCppEngine) -> None:
    generation, _ = await _opened(engine, 16)
    await _until(lambda: engine._streams and isinstance(_last(engine), wire.Finished))  # all came
    tokens = generation.take_ready(tokens_only=True)
    assert len(tokens) == 15 and all(type(e) is TokenEvent for e in tokens)
    assert generation.has_ready()  # the end is left for a full read
    assert generation.take_ready(tokens_only=True) == []
    end = generation.take_ready()
    assert len(end) == 1 and isinstance(end[0], FinishEvent)
    assert engine.in_flight == 0


def _last(engine: LlamaCppEngine) -> object:
    inbox = next(iter(engine._streams.values()))
    return inbox.items[-1] if inbox.items else None


async def test_an_error_comes_after_the_events_before_it(engine: LlamaCppEngine) -> None:
    """A worker that dies mid-stream: the tokens that came first are handed out, then the
    next take raises; nothing is lost and nothing follows."""
    generation, _ = await _opened(engine, 400)
    await _until(lambda: len(next(iter(engine._streams.values())).items) >= 3)
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    await _until(lambda: isinstance(_last(engine), BaseException))
    tokens = generation.take_ready()
    assert len(tokens) >= 3 and all(type(e) is TokenEvent for e in tokens)
    with pytest.raises(EngineCrashedError):
        generation.take_ready()
    assert generation.take_ready() == [] and engine.in_flight == 0


def _job(engine: LlamaCppEngine, max_tokens: int) -> tuple[Branch, Job]:
    branch = fake_table({"q8_0": engine}).models["tiny-llama"].branches[0]
    req = CompletionRequest(
        model="tiny-llama:q8_0",
        prompt="def fib(n):",
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        stream=True,
    )
    decision = pinned("tiny-llama", branch.id, ready=True, retry_after_s=1.0)
    return branch, build_job(
        req, decision, (branch,), None, max_tokens=max_tokens, deadline=None, grammar=None
    )


async def _streamed(
    engine: LlamaCppEngine, max_tokens: int, settings: StreamSettings, *, lag_s: float = 0.0
) -> tuple[Run, list[bytes], list[str]]:
    """One streamed completion through a run, the stream store and the inline path: its
    run, every event's data, and the task each event was appended in."""
    branch, job = _job(engine, max_tokens)
    stream = aiter(engine.generate(job.requests[0]))
    pending = [await anext(stream), await anext(stream)]
    run = Run(job, branch, [stream], [pending[0].prompt_tokens], pending=[pending])
    renderer = ResponseRenderer(run)
    first, rest = payloads(run, renderer)
    store = StreamStore(settings)
    kept = store.open("k", "acme", rest, close=run.close, grace_s=0, first=first)
    appended_in: list[str] = []
    append, extend = kept.append, kept.extend

    def task() -> str:
        current = asyncio.current_task()
        return current.get_name() if current else ""

    def spy(data: bytes) -> None:
        appended_in.append(task())
        append(data)

    def spy_extend(datas: Sequence[bytes]) -> None:
        appended_in.extend(task() for _ in datas)
        extend(datas)

    kept.append = spy  # type: ignore[method-assign]
    kept.extend = spy_extend  # type: ignore[method-assign]
    write_inline(run, renderer, kept)
    data: list[bytes] = []  # from the first event (the store holds `first` too)
    async for batch in kept.follow_batches(None, keepalive_s=30):
        assert batch is not None
        data.extend(d for _, d in batch)
        if lag_s:
            await asyncio.sleep(lag_s)
    await store.close()
    return run, data, appended_in


def _text(data: list[bytes]) -> str:
    chunks = [json.loads(d) for d in data if d != b"[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


async def test_a_streams_tokens_are_rendered_in_the_engines_task(engine: LlamaCppEngine) -> None:
    run, data, appended_in = await _streamed(engine, 64, StreamSettings())
    assert data[-1] == b"[DONE]" and run._pumps == []  # no pump task
    assert run.usage_tokens > 64
    # the worker's reader task appended the tokens; the producer's woke for the end
    assert appended_in.count(f"read:{engine.name}") >= 32
    assert appended_in[-1] == "stream:k"
    assert _text(data) == await _greedy_text(engine, 64)


async def _greedy_text(engine: LlamaCppEngine, max_tokens: int) -> str:
    """The text of ``_request``, read one event at a time (its end's held-back text too)."""
    events = [e async for e in engine.generate(_request(max_tokens))]
    end = events[-1]
    assert isinstance(end, FinishEvent)
    return "".join(e.text for e in events if isinstance(e, TokenEvent)) + end.text


async def test_a_slow_reader_gets_every_token_in_order_through_the_producer(
    engine: LlamaCppEngine,
) -> None:
    """A stream whose window is full refuses the inline hand-over: the tokens wait for the
    producer's task, which waits for room, and come out in order all the same."""
    settings = StreamSettings(max_events_per_stream=16)  # 14 ahead of the reader at most
    _, data, appended_in = await _streamed(engine, 96, settings, lag_s=0.02)
    assert _text(data) == await _greedy_text(engine, 96) and data[-1] == b"[DONE]"
    assert appended_in.count("stream:k") > 1  # the producer took over where it was full


async def test_a_failing_inline_consumer_ends_the_stream_not_the_worker(
    engine: LlamaCppEngine,
) -> None:
    branch, job = _job(engine, 64)
    pid = engine.pid
    stream = aiter(engine.generate(job.requests[0]))
    pending = [await anext(stream), await anext(stream)]
    outcome: list[bool | None] = []
    run = Run(
        job, branch, [stream], [1], pending=[pending], on_done=lambda r, ok: outcome.append(ok)
    )
    _, rest = payloads(run)

    def broken(batch: list[tuple[int, EngineEvent]]) -> bool:
        raise RuntimeError("a bug in rendering")

    run.inline = broken
    data = [d async for ds in rest for d in ds]
    assert b"internal error while streaming" in data[-1]
    assert outcome == [None] and engine.in_flight == 0  # cut: the generation was cancelled
    assert engine.ready and engine.pid == pid  # the worker's reader never saw it
    assert len(await _reference(engine, 4)) == 4  # and it serves on


async def test_a_generation_dropped_unclosed_is_cancelled_in_the_worker(
    engine: LlamaCppEngine,
) -> None:
    """A reader that breaks out of its loop and drops the generation without closing it
    frees its slot, as an async generator's finalizer did: forgotten, and cancelled."""
    posted: list[wire.Command] = []
    post = engine._post
    engine._post = lambda command: (posted.append(command), post(command))  # type: ignore[method-assign,func-returns-value]
    generation, _ = await _opened(engine, 400)
    rid = generation._rid
    assert engine.in_flight == 1
    del generation
    gc.collect()
    assert engine.in_flight == 0
    assert wire.Cancel(rid) in posted
    await _until(lambda: rid not in engine._owed)  # the worker answered the cancel
    assert len(await _reference(engine, 4)) == 4

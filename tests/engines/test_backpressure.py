"""Slow readers: a stream's buffer is bounded at every hop, and the worker pauses a
sequence whose reader falls behind, then resumes it; a reader stalled past its limit is
cut off and its slot freed."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from qrtest import demo_model_dir, fake_table
from quantroute.api.jobs import Job, build_job
from quantroute.api.run import Run
from quantroute.api.schemas import CompletionRequest
from quantroute.api.sse import payloads
from quantroute.config import StreamSettings
from quantroute.engines.base import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from quantroute.engines.fake import FakeEngine
from quantroute.engines.llamacpp.engine import STREAM_HIGH_WATER, LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.resilience.resume import StreamStore
from quantroute.routing.policy import pinned
from quantroute.routing.table import Branch


def _pinned_job(engine: FakeEngine, max_tokens: int, *, stream: bool) -> tuple[Branch, Job]:
    """A completion of ``max_tokens`` pinned to ``engine``'s one branch: its branch and job."""
    branch = fake_table({"f16": engine}).models["tiny-llama"].branches[0]
    req = CompletionRequest(
        model="tiny-llama:f16", prompt="x", max_tokens=max_tokens, stream=stream
    )
    decision = pinned("tiny-llama", branch.id, ready=True, retry_after_s=1.0)
    return branch, build_job(
        req, decision, (branch,), None, max_tokens=max_tokens, deadline=None, grammar=None
    )


@pytest.mark.slow
async def test_the_worker_pauses_for_a_slow_reader_and_resumes() -> None:
    engine = LlamaCppEngine(
        "tiny-llama:q4_k_m",
        demo_model_dir() / "q4_k_m.gguf",
        WorkerOptions(parallel=2, n_threads=1, n_ctx=2048),
        RestartPolicy(backoff_s=0.2),
    )
    await engine.start()
    try:
        n = 1500
        request = GenerationRequest(
            "slow", "def ", SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        stream = aiter(engine.generate(request))
        await anext(stream)  # start
        await asyncio.sleep(1.5)  # the reader reads nothing: ~1.5 s of decoding would be >n
        buffered = next(iter(engine._streams.values())).qsize()
        # paused at the mark (give or take the tokens decoded while "pause" was on its way,
        # more of them on a loaded machine)
        assert STREAM_HIGH_WATER <= buffered <= STREAM_HIGH_WATER + 32
        await asyncio.sleep(0.5)
        assert next(iter(engine._streams.values())).qsize() == buffered  # still paused
        tokens, finish = 0, None
        async for event in stream:  # reading resumes it, to the end
            if isinstance(event, TokenEvent):
                tokens += 1
            elif isinstance(event, FinishEvent):
                finish = event
        assert finish is not None and finish.completion_tokens == n and tokens == n
        assert finish.held  # its timing is the reader's: routing's observed speed skips it
        quick = GenerationRequest("quick", "def ", SamplingParams(max_tokens=8, temperature=0.0))
        events = [event async for event in engine.generate(quick)]  # read as it comes
        assert isinstance(events[-1], FinishEvent) and not events[-1].held
    finally:
        await engine.stop()


async def test_a_reader_stalled_past_its_limit_is_cut_off_and_the_slot_freed() -> None:
    """The stream store holds the producer back for a reader that reads nothing; past the
    stall limit the stream ends with an error and the generation is cancelled."""
    engine = FakeEngine(token_delay_s=0.001)
    branch, job = _pinned_job(engine, 400, stream=True)
    await engine.start()
    stream = aiter(engine.generate(job.requests[0]))
    pending = [await anext(stream), await anext(stream)]  # start and first token
    outcome: list[bool | None] = []
    run = Run(
        job, branch, [stream], [1], pending=[pending], on_done=lambda r, ok: outcome.append(ok)
    )
    store = StreamStore(StreamSettings(max_events_per_stream=16))  # 14 events ahead at most
    first, rest = payloads(run)
    kept = store.open(
        "k", "acme", rest, close=run.close, grace_s=0, first=first, stall_timeout_s=0.2
    )
    batches = kept.follow_batches(None, keepalive_s=5)
    await anext(batches)  # the reader takes one batch, then stalls
    await asyncio.sleep(0.6)
    assert engine.in_flight == 0  # cut off: the generation was cancelled, its slot freed
    assert outcome == [None]  # cut short: neither a success nor the branch's failure
    events = [data for batch in [b async for b in batches] if batch for _, data in batch]
    assert b"reader_stalled" in events[-1] and len(events) <= 14
    await store.close()


@pytest.mark.parametrize("crash_after", [None, 5])
async def test_a_whole_response_reads_its_one_choice_without_a_pump(
    crash_after: int | None,
) -> None:
    """One choice read whole comes straight from the engine stream, in the reader's task:
    the same events, the usage, the drift monitor's tokens and the verdict all the same."""
    from quantroute.engines.fake import FakeFaults
    from quantroute.errors import EngineError

    engine = FakeEngine(faults=FakeFaults(crash_after=crash_after))
    branch, job = _pinned_job(engine, 12, stream=False)
    await engine.start()
    stream = aiter(engine.generate(job.requests[0]))
    pending = [await anext(stream), await anext(stream)]  # start and first token
    outcome: list[bool | None] = []
    finished: list[list[int]] = []
    run = Run(
        job,
        branch,
        [stream],
        [1],
        lambda r, tokens: finished.append(list(tokens)),
        pending=[pending],
        on_done=lambda r, ok: outcome.append(ok),
    )
    tasks = len(asyncio.all_tasks())
    events = []
    with contextlib.suppress(EngineError):
        async for item in run.events():
            assert len(asyncio.all_tasks()) == tasks  # no pump task
            events.append(item)
    tokens = [e for _, e in events if isinstance(e, TokenEvent)]
    assert events[0] == (0, pending[0]) and run._pumps == []
    assert engine.in_flight == 0  # closed either way
    if crash_after is None:
        assert isinstance(events[-1][1], FinishEvent) and len(tokens) == 12
        assert outcome == [True] and finished == [[t.token_id for t in tokens]]
        assert run.usage_tokens == events[-1][1].prompt_tokens + 12
    else:
        assert len(tokens) == crash_after and outcome == [False] and finished == []


@pytest.mark.parametrize("lag_s", [0.0, 0.3])
async def test_a_run_whose_reader_fell_behind_is_held(lag_s: float) -> None:
    """A reader the run's own buffer had to wait for marks the run ``held`` (its timing is
    the reader's: routing's observed speed leaves it out), though the engine never paused."""
    engine = FakeEngine(token_delay_s=0.001)  # 300 tokens in about 0.3 s
    branch, job = _pinned_job(engine, 300, stream=True)
    await engine.start()
    stream = aiter(engine.generate(job.requests[0]))
    first = await anext(stream)
    run = Run(job, branch, [stream], [1], pending=[[first]])
    batches = aiter(run.batches())
    await anext(batches)
    await asyncio.sleep(lag_s)  # a reader that looks away while the tokens come
    async for _ in batches:
        pass
    assert run.held is (lag_s > 0)


async def test_a_streams_first_token_is_rendered_before_any_task_runs() -> None:
    """The events the service read before committing (the start and the first token)
    become the stream's first chunks at once: the response writes them without waiting
    for the stream's producer; the rest follows from the engine stream."""
    engine = FakeEngine()
    branch, job = _pinned_job(engine, 5, stream=True)
    await engine.start()
    stream = aiter(engine.generate(job.requests[0]))
    pending = [await anext(stream), await anext(stream)]  # start and first token
    run = Run(job, branch, [stream], [1], pending=[pending])
    first, rest = payloads(run)
    assert len(first) == 1 and json.loads(first[0])["choices"][0]["text"] == engine.text[0]
    assert run._pending == [[]]  # taken: not read twice
    after = [json.loads(d) for d in [d async for ds in rest for d in ds] if d != b"[DONE]"]
    text = "".join(chunk["choices"][0]["text"] for chunk in after)
    assert text == engine.text[1:5] and after[-1]["choices"][0]["finish_reason"] == "length"
    assert run.usage_tokens == pending[0].prompt_tokens + 5  # counted once each

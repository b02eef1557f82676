"""``OpenAIEngine`` against an in-process fake upstream (``tests/upstream.py``): what it
sends, what it makes of each answer, and each failure on the right side of the commit
point (before the first token: ``EngineUnavailableError``, the request moves on; after:
``EngineCrashedError``, the stream ends with an error), its probe, its load and its
bounds. Real servers are the e2e tests' (``tests/e2e/test_remote_*.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hostile import loop_gaps
from quantroute.engines.base import (
    ChatInput,
    Engine,
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.openai import OpenAIEngine, RemoteConfig
from quantroute.errors import (
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
)
from upstream import ERROR_400, HUGE_BYTES, TEXT, USAGE, FakeUpstream

CHAT = ChatInput(messages=({"role": "user", "content": "Say hello."},))


@dataclass
class Listener:
    ready: list[Engine] = field(default_factory=list)

    def engine_ready(self, engine: Engine) -> None:
        self.ready.append(engine)

    def engine_exited(self, engine: Engine, returncode: int) -> None:
        raise AssertionError("a remote engine has no process")

    def engine_failed(self, engine: Engine, cause: str) -> None:
        raise AssertionError("a remote engine is never failed")


def _config(up: FakeUpstream, model: str = "ok", **kw: Any) -> RemoteConfig:
    base: dict[str, Any] = {
        "first_token_timeout_s": 2.0,
        "idle_timeout_s": 5.0,
        "connect_timeout_s": 1.0,
        "probe_interval_s": 0.2,  # its probe's timeout is twice that (or connect + 1 s)
        "max_event_bytes": 64 << 10,
    }
    return RemoteConfig(url=up.url, model=model, **(base | kw))


@pytest.fixture
async def up() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


@pytest.fixture
async def engines() -> AsyncIterator[list[OpenAIEngine]]:
    made: list[OpenAIEngine] = []
    yield made
    for engine in made:
        await engine.stop()


async def _started(
    engines: list[OpenAIEngine], up: FakeUpstream, model: str = "ok", **kw: Any
) -> OpenAIEngine:
    engine = OpenAIEngine(f"m:{model}", _config(up, model, **kw))
    engines.append(engine)
    await engine.start()
    await _until(lambda: engine.ready)  # a loaded machine may miss the first probe's timeout
    return engine


def _request(chat: bool = True, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        "req-1",
        "rendered",
        SamplingParams(**({"max_tokens": 8, "temperature": 0.0} | sampling)),
        trace_context=(("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),),
        chat=CHAT if chat else None,
    )


async def _run(engine: OpenAIEngine, request: GenerationRequest) -> tuple[list[EngineEvent], Any]:
    """Every event until the stream ends, and the error it ended with (or None)."""
    events: list[EngineEvent] = []
    try:
        async for event in engine.generate(request):
            events.append(event)
    except EngineError as exc:
        return events, exc
    return events, None


def _text(events: list[EngineEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


async def _until(predicate: Any, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.01)


# -- lifecycle and probes ---------------------------------------------------------------


async def test_start_probes_and_is_ready(up: FakeUpstream, engines: list[OpenAIEngine]) -> None:
    engine = OpenAIEngine("m:ok", _config(up, probe_interval_s=2.0))
    engines.append(engine)
    listener = Listener()
    engine.listen(listener)
    assert not engine.ready
    await engine.start()
    assert engine.ready and listener.ready == [engine]
    assert "/health" in up.probes
    assert engine.info is not None and engine.info.parallel == 64  # max_connections: unknown
    assert engine.pid is None and engine.model_path is None and engine.failure is None
    assert engine.can_score and not engine.writes_logits  # scored by top-k, never a reference
    health = engine.health()
    assert health["healthy"] is True and health["url"] == up.url


async def test_without_health_it_probes_the_models_list(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    up.has_health = False
    engine = await _started(engines, up)
    assert engine.ready
    up.probes.clear()
    await _until(lambda: len(up.probes) >= 2)
    assert "/health" not in up.probes and "/v1/models" in up.probes


async def test_stop_ends_the_probe_loop_even_when_a_probe_loses_the_cancellation(
    up: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11 may lose a cancellation that lands as an awaited call completes (its
    ``wait_for``, a library's own scope): the probe then returns as if nothing happened.
    The loop stops all the same, so ``stop()`` ends instead of waiting forever."""
    engine = await _started([], up)
    probing = asyncio.Event()

    async def swallowing_probe() -> bool:
        probing.set()
        with contextlib.suppress(asyncio.CancelledError):  # what the race does: it is gone
            await asyncio.sleep(10)
        return True

    monkeypatch.setattr(engine, "probe", swallowing_probe)
    await asyncio.wait_for(probing.wait(), 5)
    await asyncio.wait_for(engine.stop(), 5)  # before the fix: forever
    assert not engine.ready


async def test_a_failed_probe_takes_it_down_and_a_good_one_back(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    listener = Listener()
    engine = OpenAIEngine("m:ok", _config(up))
    engines.append(engine)
    engine.listen(listener)
    await engine.start()
    up.healthy = False
    await _until(lambda: not engine.ready)
    assert engine.health()["reason"] == "health answered 503"
    with pytest.raises(EngineUnavailableError):
        engine.generate(_request())
    up.healthy = True
    await _until(lambda: engine.ready)
    assert engine.health()["down_since_s"] is None
    assert listener.ready == [engine]  # told once, when it first came up


async def test_a_server_that_goes_away_and_comes_back_on_its_port(
    engines: list[OpenAIEngine],
) -> None:
    up = FakeUpstream()
    await up.start()
    port = up.port
    engine = await _started(engines, up)
    await up.stop()
    await _until(lambda: not engine.ready)
    assert engine.health()["reason"] == "cannot connect"
    again = FakeUpstream()
    await again.start(port)
    try:
        await _until(lambda: engine.ready)
        events, error = await _run(engine, _request())
        assert error is None and _text(events) == "".join(TEXT)
    finally:
        await again.stop()


async def test_a_refused_connection_takes_it_down_before_the_next_probe(
    engines: list[OpenAIEngine],
) -> None:
    up = FakeUpstream()
    await up.start()
    engine = await _started(engines, up, probe_interval_s=60)
    await up.stop()
    assert engine.ready  # no probe yet
    events, error = await _run(engine, _request())
    assert isinstance(error, EngineUnavailableError) and events == []
    assert not engine.ready


async def test_a_stopped_engine_is_not_ready(up: FakeUpstream) -> None:
    engine = OpenAIEngine("m:ok", _config(up))
    await engine.start()
    await engine.stop()
    assert not engine.ready
    with pytest.raises(EngineUnavailableError):
        engine.generate(_request())


# -- load -------------------------------------------------------------------------------


async def test_load_from_llama_server_metrics(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    up.metrics = (
        "llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n"
        "llamacpp:kv_cache_usage_ratio 0.1\n"
    )
    engine = await _started(engines, up, parallel=4)
    assert engine.server == "llama-server"  # auto: told by its metrics
    assert engine.in_flight == 5  # its running + waiting, other gateways' too
    up.metrics = "llamacpp:requests_processing 1\nllamacpp:kv_cache_usage_ratio 0.99\n"
    await _until(lambda: engine.in_flight == 4)  # a full KV cache: every slot busy
    assert engine.health()["kv_usage"] == 0.99


async def test_a_configured_server_kind_is_kept(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    up.metrics = "vllm:num_requests_running 1\n"
    engine = await _started(engines, up, server="sglang")
    assert engine.server == "sglang"


async def test_without_metrics_its_load_is_its_own_requests(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="slow")
    assert engine.in_flight == 0
    stream = aiter(engine.generate(_request(max_tokens=1000)))
    assert isinstance(await anext(stream), StartEvent)
    assert isinstance(await anext(stream), TokenEvent)
    assert engine.in_flight == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.in_flight == 0
    assert up.probes.count("/metrics") == 1  # a 404 once: not asked again


# -- what is sent -----------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_a_stream_relayed(up: FakeUpstream, engines: list[OpenAIEngine], chat: bool) -> None:
    engine = await _started(engines, up, api_key="sk-secret-123")
    events, error = await _run(engine, _request(chat))
    assert error is None
    assert isinstance(events[0], StartEvent)
    assert [e.text for e in events if isinstance(e, TokenEvent)] == list(TEXT)
    assert events[-1] == FinishEvent(
        FinishReason.STOP, USAGE["prompt_tokens"], USAGE["completion_tokens"]
    )
    (call,) = up.calls
    assert call.path == ("/v1/chat/completions" if chat else "/v1/completions")
    assert call.body["model"] == "ok" and call.body["stream"] is True
    assert call.body["stream_options"] == {"include_usage": True}
    # chat to an unknown server ("auto", no metrics): OpenAI's max_completion_tokens
    assert call.body["max_completion_tokens" if chat else "max_tokens"] == 8
    assert call.body["temperature"] == 0.0
    if chat:
        assert call.body["messages"] == [dict(CHAT.messages[0])]
    else:
        assert call.body["prompt"] == "rendered"
    assert call.headers["authorization"] == "Bearer sk-secret-123"
    assert call.headers["traceparent"].startswith("00-aaaa")


async def test_the_key_is_never_in_a_repr(up: FakeUpstream) -> None:
    config = _config(up, api_key="sk-secret-123")
    assert "sk-secret" not in repr(config) and "sk-secret" not in str(config)


async def test_connections_are_kept_alive(up: FakeUpstream, engines: list[OpenAIEngine]) -> None:
    engine = await _started(engines, up, probe_interval_s=60)
    for _ in range(3):
        assert (await _run(engine, _request()))[1] is None
    # one connection for the probe's GETs and the three streams, one after another
    assert len(up.calls) == 3


async def test_logprobs_come_back_per_token(up: FakeUpstream, engines: list[OpenAIEngine]) -> None:
    engine = await _started(engines, up, model="logprobs")
    events, error = await _run(engine, _request(logprobs=True, top_logprobs=2))
    assert error is None
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [(t.text, t.token_id, t.logprob) for t in tokens] == [
        (text, 100 + i, -0.5 * i) for i, text in enumerate(TEXT)
    ]
    assert tokens[1].top_logprobs == ((101, TEXT[1], -0.5), (7, "?", -9.0))
    assert isinstance(events[-1], FinishEvent) and events[-1].reason is FinishReason.LENGTH
    assert up.calls[0].body["logprobs"] is True and up.calls[0].body["top_logprobs"] == 2


async def test_an_extension_its_server_does_not_take_is_a_400_before_any_call(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, server="openai")
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(_request(top_k=5))
    assert info.value.param == "top_k"
    assert up.calls == []


# -- before the first token: unavailable (the request moves on) --------------------------


@pytest.mark.parametrize("model", ["stall", "stall-after-head"])
async def test_no_first_token_in_time(
    up: FakeUpstream, engines: list[OpenAIEngine], model: str
) -> None:
    engine = await _started(engines, up, model=model, first_token_timeout_s=0.3)
    started = time.monotonic()
    events, error = await _run(engine, _request())
    took = time.monotonic() - started
    assert isinstance(error, EngineUnavailableError)
    assert not [e for e in events if isinstance(e, TokenEvent)]
    assert 0.25 < took < 2.0
    (call,) = up.calls
    await asyncio.to_thread(call.gone.wait, 2.0)  # the upstream request is closed
    assert call.closed is not None


async def test_the_deadline_cuts_the_first_token_wait(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="stall", first_token_timeout_s=30)
    started = time.monotonic()
    _, error = await _run(engine, _request(deadline=time.monotonic() + 0.3))
    assert isinstance(error, EngineUnavailableError)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("model", ["http500", "http429", "http401", "no-such-model"])
async def test_the_server_s_fault_is_unavailable(
    up: FakeUpstream, engines: list[OpenAIEngine], model: str
) -> None:
    engine = await _started(engines, up, model=model)
    events, error = await _run(engine, _request())
    assert isinstance(error, EngineUnavailableError) and not isinstance(error, EngineCrashedError)
    assert events == []
    assert engine.ready  # one refusal is the breaker's to count, not the probe's


async def test_a_400_passes_through_with_its_code(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="http400")
    with pytest.raises(InvalidRequestError) as info:
        await _run(engine, _request())
    assert info.value.error_code == "context_length_exceeded"
    assert ERROR_400["error"]["message"] in str(info.value)


@pytest.mark.parametrize(
    "model",
    ["bad-json-first", "huge-first", "drop-first", pytest.param("end-early")],
)
async def test_a_broken_stream_before_any_token_is_unavailable(
    up: FakeUpstream, engines: list[OpenAIEngine], model: str
) -> None:
    engine = await _started(engines, up, model=model)
    events, error = await _run(engine, _request())
    assert isinstance(error, EngineUnavailableError), error
    assert not [e for e in events if isinstance(e, TokenEvent)]


# -- after the first token: crashed (the stream ends with an error) ----------------------


@pytest.mark.parametrize(
    ("model", "tokens"),
    [
        ("bad-json", 1),
        ("error-event", 1),
        ("drop", 2),
        ("huge", 1),
        pytest.param("truncated", 2),
    ],
)
async def test_a_broken_stream_after_the_first_token_is_a_crash(
    up: FakeUpstream, engines: list[OpenAIEngine], model: str, tokens: int
) -> None:
    engine = await _started(engines, up, model=model)
    events, error = await _run(engine, _request())
    assert isinstance(error, EngineCrashedError), error
    assert _text(events) == "".join(TEXT[:tokens])
    assert not any(isinstance(e, FinishEvent) for e in events)


async def test_a_huge_event_is_cut_off_at_the_bound(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    """The engine stops reading past ``max_event_bytes`` and closes the connection: the
    upstream could write only what the socket buffers hold beyond that."""
    engine = await _started(engines, up, model="huge", max_event_bytes=64 << 10)
    _, error = await _run(engine, _request())
    assert isinstance(error, EngineCrashedError)
    (call,) = up.calls
    await asyncio.to_thread(call.gone.wait, 5.0)
    assert call.closed is not None
    assert call.sent < 32 << 20 < HUGE_BYTES


async def test_idle_upstream_after_the_first_token(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    """A stream that stalls after its first token ends at ``idle_timeout_s``."""

    async def stall_after_one(ex: Any) -> None:
        await ex.head()
        await ex.token("one")
        await ex.until_gone()

    up.behaviours["stall-after-one"] = stall_after_one
    engine = await _started(engines, up, model="stall-after-one", idle_timeout_s=0.3)
    started = time.monotonic()
    events, error = await _run(engine, _request())
    assert isinstance(error, EngineCrashedError)
    assert _text(events) == "one" and time.monotonic() - started < 3.0


async def test_the_deadline_ends_a_stream_with_what_came(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="slow")
    events, error = await _run(engine, _request(max_tokens=1000, deadline=time.monotonic() + 0.5))
    assert error is None
    assert isinstance(events[-1], FinishEvent) and events[-1].reason is FinishReason.DEADLINE
    assert 2 <= len([e for e in events if isinstance(e, TokenEvent)]) < 100


async def test_a_client_that_leaves_closes_the_upstream_request(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="slow")
    stream = aiter(engine.generate(_request(max_tokens=1000)))
    for _ in range(3):
        await anext(stream)
    left = time.monotonic()
    await stream.aclose()  # type: ignore[attr-defined]
    (call,) = up.calls
    await asyncio.to_thread(call.gone.wait, 2.0)
    assert call.closed is not None and call.closed - left < 1.0


# -- bounds on what a server may send ----------------------------------------------------


async def test_many_data_lines_cost_little(up: FakeUpstream, engines: list[OpenAIEngine]) -> None:
    """70 kB of one-byte data lines: linear splitting takes milliseconds."""
    engine = await _started(engines, up, model="data-lines", max_event_bytes=1 << 20)
    started = time.monotonic()
    _, gap = await loop_gaps(_run(engine, _request()))
    took = time.monotonic() - started
    assert took < 1.5, f"{took:.1f} s to relay it; the event loop stood still {gap:.1f} s"


async def test_a_deeply_nested_event_is_a_crash(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="deep-json", max_event_bytes=1 << 20)
    events: list[EngineEvent] = []
    with pytest.raises(EngineCrashedError):
        async for event in engine.generate(_request()):
            events.append(event)


async def test_an_odd_logprobs_shape_is_never_an_unexpected_exception(
    up: FakeUpstream, engines: list[OpenAIEngine]
) -> None:
    engine = await _started(engines, up, model="odd-logprobs")
    _, error = await _run(engine, _request())
    assert error is None or isinstance(error, EngineCrashedError)


async def test_scoring_is_refused(up: FakeUpstream, engines: list[OpenAIEngine]) -> None:
    """Remote fidelity is measured through top logprobs (or declared), never logits."""
    engine = await _started(engines, up)
    with pytest.raises(EngineError):
        await engine.write_logits("p", [1], Path("/nonexistent/logits"))

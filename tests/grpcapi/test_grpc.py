"""The gRPC API (``quantroute.grpcapi``) on the real app: generation streamed from the
demo model and from fake engines, keys, deadlines, health, reflection, cancellation,
and every error as its status code (docs/grpc.md)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from qrtest import ADMIN, ADMIN_KEY, demo_repo_copy, fake_table, free_port, serving
from quantroute.api.app import create_app
from quantroute.api.gateway import Gateway
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.errors import (
    AuthenticationError,
    EngineCrashedError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QuantrouteError,
    RateLimitError,
    ServiceUnavailableError,
)
from quantroute.grpcapi import SERVICE_NAME, start_grpc, status_of
from quantroute.grpcapi.proto import pb, pb_grpc
from quantroute.grpcapi.servicer import Call
from quantroute.grpcapi.status import ERROR_CODE, ERROR_PARAM, ERROR_TYPE, RETRY_AFTER

KEY = "sk-grpc-acme"
TEXT = "def fake():\n    return 42\n"  # FakeEngine's text, one character a token


class Served:
    """A running app with its gRPC server: a stub, an HTTP client and the gateway."""

    def __init__(self, channel: grpc.aio.Channel, http: httpx.AsyncClient, gateway: Gateway):
        self.channel = channel
        self.stub = pb_grpc.QuantrouteStub(channel)
        self.http = http
        self.gateway = gateway


@contextlib.asynccontextmanager
async def grpc_serving(app: FastAPI) -> AsyncIterator[Served]:
    """The app's lifespan with the gRPC server wired in as the lead's lifespan wires it."""
    async with serving(app) as (http, gateway):
        server = await start_grpc(
            app.state.service, app.state.tenants, app.state.settings, port=free_port()
        )
        assert server is not None
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                yield Served(channel, http, gateway)
        finally:
            await server.stop(0)


def _app(
    engines: dict[str, Any] | None = None, tmp_path: Path | None = None, tenants: str = ""
) -> FastAPI:
    auth: dict[str, Any] = {}
    if tenants and tmp_path is not None:
        (tmp_path / "tenants.yaml").write_text(tenants)
        auth["tenants_file"] = str(tmp_path / "tenants.yaml")
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY, "max_body_bytes": 1 << 16},
        limits={"max_tokens": 64},
        auth=auth,
    )
    return create_app(settings, fake_table(engines))


async def _collect(call: Any) -> tuple[list[pb.Chunk], dict[str, str]]:
    chunks = [chunk async for chunk in call]
    return chunks, dict(await call.initial_metadata())


def _text(chunks: list[pb.Chunk], index: int = 0) -> str:
    return "".join(c.text for chunk in chunks for c in chunk.choices if c.index == index)


async def _error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    return info.value


def _trailing(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in err.trailing_metadata() or () if isinstance(v, str)}


# -- the error table, on plain data ---------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequestError("bad", param="temperature"), grpc.StatusCode.INVALID_ARGUMENT),
        (AuthenticationError("no key"), grpc.StatusCode.UNAUTHENTICATED),
        (PermissionDeniedError("closed"), grpc.StatusCode.PERMISSION_DENIED),
        (NotFoundError("no such model"), grpc.StatusCode.NOT_FOUND),
        (PayloadTooLargeError("too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (RateLimitError("over", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ServiceUnavailableError("shed", retry_after_s=1), grpc.StatusCode.UNAVAILABLE),
        (EngineCrashedError("died"), grpc.StatusCode.UNAVAILABLE),
        (QuantrouteError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_maps_to_its_status_code(exc: QuantrouteError, code: grpc.StatusCode) -> None:
    status = status_of(exc)
    assert status.code is code
    assert status.details == exc.message
    trailing = dict(status.trailing)
    assert trailing[ERROR_TYPE] == exc.type
    assert trailing.get(ERROR_CODE) == exc.error_code
    assert trailing.get(ERROR_PARAM) == exc.param
    retry = getattr(exc, "retry_after_s", None)
    assert trailing.get(RETRY_AFTER) == (None if retry is None else str(max(1, math.ceil(retry))))


def test_a_503_is_the_deadline_s_once_the_deadline_passed() -> None:
    exc = ServiceUnavailableError("the request's deadline passed before its first token")
    now = time.monotonic()
    assert status_of(exc, now - 0.001).code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(exc, now + 60).code is grpc.StatusCode.UNAVAILABLE  # still time: shed
    assert status_of(exc, None).code is grpc.StatusCode.UNAVAILABLE
    other = InvalidRequestError("bad")  # only a 503 is the deadline's
    assert status_of(other, now - 1).code is grpc.StatusCode.INVALID_ARGUMENT


class _Context:
    """What ``Call.of`` reads of a servicer context."""

    def __init__(self, left_s: float | None):
        self.left_s = left_s

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return (
            ("x-quantroute-user", "first"),
            ("x-quantroute-user", "second"),
            ("trace-bin", b"\x00\x01"),
        )

    def time_remaining(self) -> float | None:
        return self.left_s


@pytest.mark.parametrize(
    ("left_s", "timeout_s", "expired"),
    [
        (None, None, False),  # no deadline
        (2.5, 2.5, False),
        (3600.0, 3600.0, False),  # the HTTP API's longest
        (3600.5, None, False),  # past it: gRPC's alone
        (0.0005, 0.0005, True),  # under a millisecond: gone
        (0.0, 0.0, True),
    ],
)
def test_a_call_s_deadline_and_metadata(
    left_s: float | None, timeout_s: float | None, expired: bool
) -> None:
    call = Call.of(_Context(left_s))  # type: ignore[arg-type]  # a stand-in context
    assert (call.timeout_s, call.expired) == (timeout_s, expired)
    assert (call.deadline is None) == (left_s is None)
    assert call.headers == {"x-quantroute-user": "first"}  # the first; binary values: none


def test_the_draft_is_in_the_metadata_only_where_the_worker_drafted_the_request() -> None:
    """As over HTTP: ``x-quantroute-draft`` names the reference's draft when the worker's
    start said it drafts this request (``Run.drafted``), not merely because it could."""
    from types import SimpleNamespace

    from quantroute.grpcapi.convert import branch_metadata

    branch = SimpleNamespace(
        id="m:f16", version=None, draft="m:q4_k_m", artifact=SimpleNamespace(sha256="ab" * 32)
    )
    job = SimpleNamespace(id="r1", decision=SimpleNamespace(reason="only-feasible"))
    for drafted in (True, False):
        run = SimpleNamespace(branch=branch, job=job, drafted=drafted)
        head = dict(branch_metadata(run))  # type: ignore[arg-type]  # a stand-in run
        assert head["x-quantroute-branch"] == "m:f16"
        assert head.get("x-quantroute-draft") == ("m:q4_k_m" if drafted else None)


# -- generation on fake engines ---------------------------------------------------------------


async def test_a_completion_streams_in_chunks_with_its_branch_and_usage() -> None:
    async with grpc_serving(_app()) as s:
        call = s.stub.Generate(
            pb.GenerateRequest(model="tiny-llama:q8_0", prompt=["hello"], max_tokens=10, n=2)
        )
        chunks, head = await _collect(call)
    assert head["x-quantroute-branch"] == "tiny-llama:q8_0"
    assert head["x-quantroute-route-reason"]
    assert head["x-request-id"] == chunks[0].id.removeprefix("cmpl-")
    assert {c.model for c in chunks} == {"tiny-llama:q8_0"}
    assert _text(chunks, 0) == _text(chunks, 1) == TEXT[:10]
    ends = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert ends == {0: "length", 1: "length"}
    assert [chunk.HasField("usage") for chunk in chunks][-1]
    assert not any(chunk.HasField("usage") for chunk in chunks[:-1])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len("hello") + 1, 20)
    assert usage.total_tokens == usage.prompt_tokens + 20


async def test_a_chat_streams_and_a_stop_sequence_ends_it() -> None:
    async with grpc_serving(_app()) as s:
        request = pb.ChatRequest(
            model="tiny-llama",
            messages=[pb.Message(role="system", content=""), pb.Message(role="user", content="hi")],
            max_tokens=40,
            stop=["42"],
        )
        chunks, head = await _collect(s.stub.Chat(request))
    assert chunks[0].id.startswith("chatcmpl-")
    assert head["x-quantroute-branch"].startswith("tiny-llama:")
    assert _text(chunks) == TEXT[: TEXT.index("42")]
    assert chunks[-1].choices[-1].finish_reason == "stop"


async def test_metadata_carries_the_http_headers_a_request_s_routing_reads() -> None:
    """``x-quantroute-quality`` as metadata is the header's: a tier, or a 400 naming it."""
    async with grpc_serving(_app()) as s:
        request = pb.GenerateRequest(model="tiny-llama", prompt=["x"], max_tokens=2)
        _, head = await _collect(
            s.stub.Generate(request, metadata=[("x-quantroute-quality", "exact")])
        )
        assert head["x-quantroute-branch"] == "tiny-llama:f16"  # the reference alone is exact
        err = await _error(s.stub.Generate(request, metadata=[("x-quantroute-quality", "best")]))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _trailing(err)[ERROR_PARAM] == "x-quantroute-quality"


# -- keys ------------------------------------------------------------------------------


async def test_with_keys_a_call_needs_one_as_http_does(tmp_path: Path) -> None:
    tenants = f'tenants: {{acme: {{keys: ["{KEY}"]}}}}'
    async with grpc_serving(_app(tmp_path=tmp_path, tenants=tenants)) as s:
        request = pb.GenerateRequest(model="tiny-llama", prompt=["x"], max_tokens=3)
        for metadata in ([], [("authorization", "Bearer sk-wrong")], [("authorization", KEY)]):
            err = await _error(s.stub.Generate(request, metadata=metadata))
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED, metadata
            assert _trailing(err)[ERROR_CODE] == "invalid_api_key"
            assert KEY not in (err.details() or "")
        mine = [("authorization", f"Bearer {KEY}")]
        chunks, _ = await _collect(s.stub.Generate(request, metadata=mine))
        assert _text(chunks) == TEXT[:3]
        # two keys at once: which counts would be a guess, so neither does (api/auth.py)
        both = [*mine, ("authorization", f"Bearer {KEY}")]
        err = await _error(s.stub.Generate(request, metadata=both))
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        # the model list: a client key or the admin key, as GET /v1/models
        err = await _error(s.stub.ListModels(pb.ListModelsRequest()))
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        for metadata in (mine, [("authorization", ADMIN["authorization"])]):
            listed = await s.stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            http = (await s.http.get("/v1/models", headers=dict(metadata))).json()
            assert [m.id for m in listed.data] == [m["id"] for m in http["data"]]
            assert "tiny-llama" in [m.id for m in listed.data]


async def test_a_tenant_over_its_limit_is_resource_exhausted_with_retry_after(
    tmp_path: Path,
) -> None:
    tenants = f'tenants: {{acme: {{keys: ["{KEY}"], requests_per_minute: 1}}}}'
    async with grpc_serving(_app(tmp_path=tmp_path, tenants=tenants)) as s:
        request = pb.GenerateRequest(model="tiny-llama", prompt=["x"], max_tokens=2)
        mine = [("authorization", f"Bearer {KEY}")]
        await _collect(s.stub.Generate(request, metadata=mine))
        err = await _error(s.stub.Generate(request, metadata=mine))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = _trailing(err)
    assert trailing[ERROR_CODE] == "rate_limit_exceeded"
    assert int(trailing[RETRY_AFTER]) >= 1


# -- errors as status codes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5.0}, "temperature"),
        ({"max_tokens": 65}, "max_tokens"),  # the settings' bound (check_limits)
        ({"n": 9}, "n"),
        ({"logit_bias": {300: 1.0}}, "logit_bias"),  # outside the fake's 256-token vocabulary
        ({"quality": pb.Quality(tier="best")}, "quality"),
        ({"quality": pb.Quality(bounds=pb.Bounds(max_kld=11))}, "quality.max_kld"),
        ({"quality": pb.Quality()}, "quality"),  # neither a tier nor bounds
        ({"prompt_tokens": [1, 2]}, "prompt"),  # and prompt too
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
async def test_a_bad_field_is_invalid_argument_naming_it(
    fields: dict[str, Any], param: str
) -> None:
    async with grpc_serving(_app()) as s:
        request = pb.GenerateRequest(model="tiny-llama", prompt=["x"], max_tokens=2)
        request.MergeFrom(pb.GenerateRequest(**fields))  # a set field overrides, a list adds
        err = await _error(s.stub.Generate(request))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    trailing = _trailing(err)
    assert (trailing[ERROR_TYPE], trailing.get(ERROR_PARAM)) == ("invalid_request_error", param)


async def test_a_bad_chat_message_and_an_unknown_model() -> None:
    async with grpc_serving(_app()) as s:
        bad = pb.ChatRequest(model="tiny-llama", messages=[pb.Message(role="robot", content="x")])
        err = await _error(s.stub.Chat(bad))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert _trailing(err)[ERROR_PARAM] == "messages.0.role"
        none = pb.ChatRequest(model="tiny-llama")
        err = await _error(s.stub.Chat(none))
        assert (err.code(), _trailing(err)[ERROR_PARAM]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages",
        )
        unknown = pb.GenerateRequest(model="no-such-model", prompt=["x"])
        err = await _error(s.stub.Generate(unknown))
        assert err.code() is grpc.StatusCode.NOT_FOUND
        assert _trailing(err)[ERROR_CODE] == "model_not_found"


async def test_a_message_over_the_body_limit_is_refused() -> None:
    async with grpc_serving(_app()) as s:  # max_body_bytes: 64 KiB
        big = pb.GenerateRequest(model="tiny-llama", prompt=["x" * (1 << 17)])
        err = await _error(s.stub.Generate(big))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_engines_that_refuse_are_unavailable_and_a_crash_mid_stream_ends_it() -> None:
    refusing = {n: FakeEngine(faults=FakeFaults(refuse=True)) for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(refusing)) as s:
        err = await _error(s.stub.Generate(pb.GenerateRequest(model="tiny-llama", prompt=["x"])))
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert _trailing(err)[ERROR_CODE] == "engine_unavailable"
    crashing = {n: FakeEngine(faults=FakeFaults(crash_after=4)) for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(crashing)) as s:
        call = s.stub.Generate(
            pb.GenerateRequest(model="tiny-llama:f16", prompt=["x"], max_tokens=20)
        )
        got: list[pb.Chunk] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                got.append(chunk)
    assert _text(got) == TEXT[:4]  # what came before the crash went out
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert _trailing(info.value)[ERROR_CODE] == "engine_crashed"


async def test_a_bug_is_internal_and_says_nothing_of_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _app()
    async with grpc_serving(app) as s:

        def broken(*_: object) -> dict[str, Any]:
            raise RuntimeError("secret detail")

        monkeypatch.setattr(app.state.service, "models", broken)
        err = await _error(s.stub.ListModels(pb.ListModelsRequest()))
    assert err.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in (err.details() or "")


# -- deadlines and cancellation ---------------------------------------------------------


async def test_a_deadline_too_short_is_deadline_exceeded() -> None:
    slow = {n: FakeEngine(token_delay_s=2.0) for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(slow)) as s:
        request = pb.GenerateRequest(model="tiny-llama:f16", prompt=["x"], max_tokens=4)
        started = time.monotonic()
        err = await _error(s.stub.Generate(request, timeout=0.2))
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.5  # cut at the deadline, not after a token
        await _idle(slow["f16"])


async def test_the_call_s_deadline_is_the_request_s() -> None:
    engines = {n: FakeEngine() for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(engines)) as s:
        request = pb.GenerateRequest(model="tiny-llama:f16", prompt=["x"], max_tokens=2)
        before = time.monotonic()
        await _collect(s.stub.Generate(request, timeout=30))
        deadline = engines["f16"].requests[-1].sampling.deadline
        # gRPC reads its clock lazily (a cached "now"): its time remaining can be a loaded
        # loop's tenth of a second long
        assert deadline is not None and before + 29 < deadline <= time.monotonic() + 30.5
        await _collect(s.stub.Generate(request))  # none: none
        assert engines["f16"].requests[-1].sampling.deadline is None
        await _collect(s.stub.Generate(request, timeout=7200))  # past an hour: gRPC's alone
        assert engines["f16"].requests[-1].sampling.deadline is None
        # and the earlier of it and the HTTP header's, as over HTTP
        header = [("x-quantroute-deadline-ms", "5000")]
        await _collect(s.stub.Generate(request, timeout=30, metadata=header))
        deadline = engines["f16"].requests[-1].sampling.deadline
        assert deadline is not None and deadline <= time.monotonic() + 5


async def _idle(engine: FakeEngine, within_s: float = 3.0) -> None:
    """Wait until ``engine`` runs nothing: its generations were cancelled."""
    stop = time.monotonic() + within_s
    while engine.in_flight and time.monotonic() < stop:  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0.02)
    assert engine.in_flight == 0


async def test_a_client_that_cancels_cancels_the_generation() -> None:
    slow = {n: FakeEngine(token_delay_s=0.05) for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(slow)) as s:
        request = pb.GenerateRequest(model="tiny-llama:q4_k_m", prompt=["x"], max_tokens=60)
        call = s.stub.Generate(request)
        got = 0
        async for _ in call:
            got += 1
            if got == 2:
                break
        assert slow["q4_k_m"].in_flight == 1
        call.cancel()
        await _idle(slow["q4_k_m"])
        # its admission ticket and the tenant's concurrency came back: the next one runs
        chunks, _ = await _collect(s.stub.Generate(request))
        assert _text(chunks) == (TEXT * 3)[:60]


# -- health, reflection, models, explain -----------------------------------------------


async def test_health_is_serving_when_ready_and_not_when_no_branch_is() -> None:
    async with grpc_serving(_app()) as s:
        health = health_pb2_grpc.HealthStub(s.channel)
        for name in ("", SERVICE_NAME):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
    down = {n: FakeEngine(faults=FakeFaults(unavailable=True)) for n in ("f16", "q8_0", "q4_k_m")}
    async with grpc_serving(_app(down)) as s:
        health = health_pb2_grpc.HealthStub(s.channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # it follows readiness: the branches come up, the service is SERVING within a poll
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
        down["q8_0"].faults.unavailable = False
        second = await asyncio.wait_for(watch.read(), timeout=5)
        assert second.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


async def test_reflection_lists_the_services_and_describes_them() -> None:
    async with grpc_serving(_app()) as s:
        stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        ]
        answers = [a async for a in stub.ServerReflectionInfo(iter(asks))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert answers[1].file_descriptor_response.file_descriptor_proto  # a client can build stubs


async def test_list_models_and_explain_answer_as_http() -> None:
    async with grpc_serving(_app()) as s:
        listed = await s.stub.ListModels(pb.ListModelsRequest())
        http = (await s.http.get("/v1/models")).json()
        assert [m.id for m in listed.data] == [m["id"] for m in http["data"]]
        branches = listed.data[0].detail["branches"]
        assert {b["id"] for b in branches} == {b["id"] for b in http["data"][0]["branches"]}
        completion = pb.GenerateRequest(
            model="tiny-llama", prompt=["x"], quality=pb.Quality(tier="fast")
        )
        explained = await s.stub.Explain(pb.ExplainRequest(completion=completion))
        body = {"model": "tiny-llama", "prompt": "x", "quality": "fast", "stream": True}
        http = (await s.http.post("/v1/route/explain", json=body)).json()
        assert explained.decision["model"] == http["model"] == "tiny-llama"
        assert explained.decision["decision"] == http["decision"]
        chat = pb.ChatRequest(model="nope", messages=[pb.Message(role="user", content="x")])
        err = await _error(s.stub.Explain(pb.ExplainRequest(chat=chat)))
        assert err.code() is grpc.StatusCode.NOT_FOUND
        err = await _error(s.stub.Explain(pb.ExplainRequest()))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT


# -- the packaged demo model: real llama.cpp workers -------------------------------------


@pytest.mark.slow
async def test_the_demo_model_streams_a_completion_and_a_chat_as_http_answers(
    tmp_path: Path,
) -> None:
    """Greedy on one branch: the gRPC stream's text is the HTTP response's, token for token."""
    settings = load_settings(repo=demo_repo_copy(tmp_path), engine={"parallel": 2, "n_threads": 1})
    async with grpc_serving(create_app(settings)) as s:
        completion = pb.GenerateRequest(
            model="tiny-llama:q4_k_m", prompt=["Once upon a time"], max_tokens=48, temperature=0
        )
        chunks, head = await _collect(s.stub.Generate(completion))
        assert head["x-quantroute-branch"] == "tiny-llama:q4_k_m"
        # streamed, not one whole reply (a reader that lags takes what came in one chunk:
        # enough tokens that it cannot lag behind all of them)
        assert len(chunks) >= 2
        body = {"model": "tiny-llama:q4_k_m", "prompt": "Once upon a time", "max_tokens": 48}
        http = (await s.http.post("/v1/completions", json=body | {"temperature": 0})).json()
        assert _text(chunks) == http["choices"][0]["text"] != ""
        assert chunks[-1].usage.completion_tokens == http["usage"]["completion_tokens"]
        assert chunks[-1].usage.prompt_tokens == http["usage"]["prompt_tokens"]

        chat = pb.ChatRequest(
            model="tiny-llama:q4_k_m",
            messages=[pb.Message(role="user", content="Tell me a story.")],
            max_tokens=12,
            temperature=0,
        )
        chunks, head = await _collect(s.stub.Chat(chat))
        assert head["x-quantroute-branch"] == "tiny-llama:q4_k_m"
        body = {
            "model": "tiny-llama:q4_k_m",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 12,
            "temperature": 0,
        }
        http = (await s.http.post("/v1/chat/completions", json=body)).json()
        assert _text(chunks) == http["choices"][0]["message"]["content"] != ""
        assert chunks[-1].choices[-1].finish_reason == http["choices"][0]["finish_reason"]

"""OpenTelemetry spans of real requests: an in-memory exporter for their shape and
attributes, the SDK's OTLP/HTTP exporter against an in-test OTLP receiver (tests/otlp.py),
and a real llama.cpp worker's decode span. Tracing off sends no context to the engines."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from otlp import exported, otlp_receiver
from qrtest import ADMIN_KEY, demo_model_dir, fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.observability import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHAT = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "a secret prompt"}],
    "max_tokens": 4,
    "quality": "fast",
}


def _app(engines: dict[str, FakeEngine], **observability: object):  # type: ignore[no-untyped-def]
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY},
        observability=observability,
    )
    return create_app(settings, fake_table(engines))  # type: ignore[arg-type]


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


async def test_a_request_is_one_server_span_with_admission_routing_and_generations() -> None:
    refusing = FakeEngine(faults=FakeFaults(refuse=True))
    engines = {"f16": refusing, "q8_0": FakeEngine(), "q4_k_m": FakeEngine()}
    app = _app(engines)
    exporter = InMemorySpanExporter()
    app.state.gateway.observer.tracing = Tracing(exporter, batch=False)
    headers = {"traceparent": TRACEPARENT, "baggage": "user.plan=pro"}
    async with serving(app) as (client, _):
        r = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 200
    spans = _by_name(exporter.get_finished_spans())
    (root,) = spans["chat tiny-llama"]
    assert root.kind is SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the client's trace, continued
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    attrs = root.attributes or {}
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny-llama"
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert attrs["gen_ai.response.id"] == r.headers["x-request-id"]
    answered = r.headers["x-quantroute-branch"]
    assert attrs["quantroute.branch"] == answered != "tiny-llama:f16"
    assert attrs["quantroute.route.reason"] == r.headers["x-quantroute-route-reason"]
    assert "a secret prompt" not in repr(attrs)
    (fallback,) = [e for e in root.events if e.name == "quantroute.fallback"]
    assert fallback.attributes == {
        "quantroute.fallback.from": "f16",
        "quantroute.fallback.to": answered.partition(":")[2],
        "quantroute.fallback.reason": "engine_unavailable",
    }
    for name in ("quantroute.admission", "quantroute.routing"):
        (child,) = spans[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    failed, served = sorted(spans["quantroute.generation"], key=lambda s: s.start_time or 0)
    assert failed.status.status_code is StatusCode.ERROR
    assert (failed.attributes or {})["quantroute.branch"] == "tiny-llama:f16"
    assert (served.attributes or {})["quantroute.branch"] == answered
    assert (served.attributes or {})["quantroute.precision"] == answered.partition(":")[2]
    assert (served.attributes or {})["quantroute.device"] == "sim:0"
    assert served.status.status_code is not StatusCode.ERROR
    assert [e.name for e in served.events] == ["gen_ai.first_token"]
    # the engine got the generation span's context, the client's baggage with it
    carried = dict(engines[answered.partition(":")[2]].requests[-1].trace_context)
    assert carried["traceparent"].split("-")[1] == TRACE_ID
    assert carried["traceparent"].split("-")[2] == format(served.context.span_id, "016x")
    assert carried["baggage"] == "user.plan=pro"


async def test_a_model_not_served_names_no_span_and_no_attribute() -> None:
    """The span's name and its model attribute take the client's text only when it names
    a model served here: an unknown one is free text (bounded, but any)."""
    app = _app({"f16": FakeEngine()})
    exporter = InMemorySpanExporter()
    app.state.gateway.observer.tracing = Tracing(exporter, batch=False)
    async with serving(app) as (client, _):
        for model in ("MARKER-not-served", "MARKER:f16", "tiny-llama:f16"):
            r = await client.post("/v1/chat/completions", json=CHAT | {"model": model})
            assert r.status_code == (200 if model == "tiny-llama:f16" else 404)
    roots = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.name for s in roots] == ["chat", "chat", "chat tiny-llama:f16"]
    for span in roots:
        assert "MARKER" not in repr(span.attributes)
    assert (roots[2].attributes or {})["gen_ai.request.model"] == "tiny-llama:f16"


async def test_tracing_off_builds_no_spans_and_carries_nothing() -> None:
    engine = FakeEngine()
    app = _app({"f16": engine})
    assert app.state.gateway.observer.tracing.tracer is None
    async with serving(app) as (client, _):
        r = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
        )
        assert r.status_code == 200
    assert engine.requests[-1].trace_context == ()


async def test_spans_reach_an_otlp_http_receiver_with_their_attributes() -> None:
    with otlp_receiver() as (base, received):
        endpoint = f"{base}/v1/traces"
        app = _app({"q4_k_m": FakeEngine()}, otlp_endpoint=endpoint, service_name="qr-test")
        async with serving(app) as (client, _):
            r = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT}
            )
            assert r.status_code == 200
        # the lifespan's end flushed the batch
        resource, spans = exported(received.bodies)
    assert resource["service.name"] == "qr-test"
    assert set(received.paths) == {"/v1/traces"}
    root = spans["chat tiny-llama"]
    assert root["_trace_id"] == TRACE_ID
    assert root["gen_ai.request.model"] == "tiny-llama"
    assert root["gen_ai.usage.output_tokens"] == 4
    assert root["quantroute.branch"] == "tiny-llama:q4_k_m"
    assert spans["quantroute.generation"]["quantroute.precision"] == "q4_k_m"
    assert {"quantroute.admission", "quantroute.routing"} <= spans.keys()


@pytest.mark.slow
async def test_a_llamacpp_worker_reports_its_decode_as_a_span() -> None:
    settings = load_settings(repo=demo_model_dir().parent, engine={"parallel": 1, "n_threads": 1})
    app = create_app(settings)
    exporter = InMemorySpanExporter()
    app.state.gateway.observer.tracing = Tracing(exporter, batch=False)
    body = {"model": "tiny-llama:q8_0", "prompt": "def main():", "max_tokens": 6,
            "temperature": 0}  # fmt: skip
    async with serving(app) as (client, _):
        r = await client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200
    spans = _by_name(exporter.get_finished_spans())
    (generation,) = spans["quantroute.generation"]
    (decode,) = spans["quantroute.decode"]
    assert decode.parent is not None and decode.parent.span_id == generation.context.span_id
    assert format(decode.context.trace_id, "032x") == TRACE_ID
    attrs = decode.attributes or {}
    assert attrs["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"] == 6
    # timed by the worker: inside the generation, after its admission there
    assert generation.start_time is not None and generation.end_time is not None
    assert decode.start_time is not None and decode.end_time is not None
    assert generation.start_time <= decode.start_time < decode.end_time <= generation.end_time
    (admitted,) = decode.events
    assert admitted.name == "quantroute.worker.admitted"
    assert generation.start_time <= admitted.timestamp <= decode.start_time

"""The standard OTEL_* variables configure tracing as they do any OpenTelemetry SDK, and
quantroute's own settings win where both are given: table tests of the resolution, and
spans sent with only ``OTEL_EXPORTER_OTLP_ENDPOINT`` set reaching a real OTLP receiver."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from otlp import exported, otlp_receiver
from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import ObservabilitySettings, load_settings, otel_environment
from quantroute.engines.fake import FakeEngine
from quantroute.errors import ConfigError
from quantroute.observability import Tracing
from quantroute.observability.otel import OtelExport, resolve

BASE = "http://collector:4318"


@pytest.mark.parametrize(
    ("env", "own", "expected"),
    [
        ({}, {}, OtelExport(endpoint=None)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": BASE}, {}, OtelExport(endpoint=f"{BASE}/v1/traces")),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": BASE + "/"},
            {},
            OtelExport(endpoint=f"{BASE}/v1/traces"),
        ),
        (  # the signal's own endpoint is taken as it is
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": BASE,
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
            },
            {},
            OtelExport(endpoint="http://t/x"),
        ),
        (  # quantroute's own endpoint wins
            {"OTEL_EXPORTER_OTLP_ENDPOINT": BASE},
            {"otlp_endpoint": "http://mine/v1/traces"},
            OtelExport(endpoint="http://mine/v1/traces"),
        ),
        (  # disabled wins over everything
            {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": BASE},
            {"otlp_endpoint": "http://mine/v1/traces"},
            OtelExport(endpoint=None),
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": BASE,
                "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret, x-tenant = blue",
                "OTEL_SERVICE_NAME": "gw-eu",
                "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=ignored",
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.25",
            },
            {},
            OtelExport(
                endpoint=f"{BASE}/v1/traces",
                headers=(("api-key", "s=cret"), ("x-tenant", "blue")),
                service_name="gw-eu",
                resource=(("deployment.environment", "prod"),),
                sampler="traceidratio",
                ratio=0.25,
            ),
        ),
        (  # the signal's headers replace the general ones; service.name from the resource
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": BASE,
                "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2",
                "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-resource",
            },
            {},
            OtelExport(
                endpoint=f"{BASE}/v1/traces", headers=(("b", "2"),), service_name="from-resource"
            ),
        ),
        (  # quantroute's own name and ratio win
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": BASE,
                "OTEL_SERVICE_NAME": "theirs",
                "OTEL_TRACES_SAMPLER": "always_off",
            },
            {"service_name": "mine", "sample_ratio": 0.5},
            OtelExport(endpoint=f"{BASE}/v1/traces", service_name="mine", ratio=0.5),
        ),
    ],
)
def test_the_standard_variables_resolve_with_quantroutes_own_settings_winning(
    env: dict[str, str], own: dict[str, object], expected: OtelExport
) -> None:
    assert resolve(ObservabilitySettings(**own), env) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "secret-value-no-key"}, "OTEL_EXPORTER_OTLP_HEADERS"),
    ],
)
def test_a_malformed_variable_is_named_without_its_value(env: dict[str, str], named: str) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": BASE, **env}
    with pytest.raises(ConfigError) as caught:
        resolve(ObservabilitySettings(), env)
    assert caught.value.message.startswith(named)
    assert "secret-value" not in caught.value.message
    assert "sometimes" not in caught.value.message


def test_samplers_are_the_sdks() -> None:
    ratio = resolve(
        ObservabilitySettings(),
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
    ).make_sampler()
    assert isinstance(ratio, ParentBased)
    plain = OtelExport(endpoint=None, sampler="traceidratio", ratio=0.1).make_sampler()
    assert isinstance(plain, TraceIdRatioBased)
    assert plain.rate == 0.1


def test_only_otel_variables_are_handed_over() -> None:
    env = {"OTEL_SERVICE_NAME": "x", "QUANTROUTE_SERVER__ADMIN_KEY": "k", "PATH": "/bin"}
    assert otel_environment(env) == {"OTEL_SERVICE_NAME": "x"}


async def test_spans_reach_the_collector_that_only_the_standard_variables_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finding: a span sent with only OTEL_EXPORTER_OTLP_ENDPOINT set never arrived."""
    with otlp_receiver() as (base, received):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20collector-key")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-from-env")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        settings = load_settings(telemetry={"devices": "sim:1x24GiB"})
        app = create_app(settings, fake_table({"q4_k_m": FakeEngine()}))  # type: ignore[arg-type]
        assert isinstance(app.state.gateway.observer.tracing, Tracing)
        assert app.state.gateway.observer.tracing.enabled
        chat = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "quality": "fast",
        }
        async with serving(app) as (client, _):
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200
        resource, spans = exported(received.bodies)
    assert set(received.paths) == {"/v1/traces"}
    assert {h["authorization"] for h in received.headers} == {"Bearer collector-key"}
    assert resource["service.name"] == "gw-from-env"
    assert resource["deployment.environment"] == "test"
    assert "chat tiny-llama" in spans

"""Where traces go, from ``observability.*`` and the standard ``OTEL_*`` variables.

Operators configure OpenTelemetry exporters the same way everywhere: with
``OTEL_EXPORTER_OTLP_ENDPOINT`` and its kin. :func:`resolve` reads those
(handed over by :func:`quantroute.config.otel_environment`, the settings module
being the only reader of the environment) beside quantroute's own settings, and
quantroute's own setting wins where both are given:

- traces endpoint: ``observability.otlp_endpoint``; else
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as is); else ``OTEL_EXPORTER_OTLP_ENDPOINT``
  (``/v1/traces`` appended over HTTP);
- protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, ``OTEL_EXPORTER_OTLP_PROTOCOL``
  (``http/protobuf``; ``grpc`` where the gRPC exporter is installed);
- headers: ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, else ``OTEL_EXPORTER_OTLP_HEADERS``
  (``k=v,k2=v2``, values URL-encoded);
- ``service.name``: ``observability.service_name`` where set; else ``OTEL_SERVICE_NAME``,
  ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, ``quantroute``; the other resource
  attributes from ``OTEL_RESOURCE_ATTRIBUTES``;
- sampling: ``observability.sample_ratio`` where set (parent-based); else
  ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``;
- ``OTEL_SDK_DISABLED=true`` turns tracing off, whatever else is set.

A malformed variable stops the server with its name and what it accepts, never its
value (a header may carry a key).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from quantroute.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

    from quantroute.config import ObservabilitySettings

HTTP = "http/protobuf"
GRPC = "grpc"
PROTOCOLS = (HTTP, GRPC)
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
DEFAULT_SERVICE = "quantroute"


@dataclass(frozen=True, slots=True)
class OtelExport:
    """Where and how spans leave; ``endpoint`` ``None`` is tracing off.

    >>> from quantroute.config import ObservabilitySettings
    >>> e = resolve(ObservabilitySettings(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    >>> e.endpoint, e.protocol, e.service_name
    ('http://c:4318/v1/traces', 'http/protobuf', 'quantroute')
    """

    endpoint: str | None
    protocol: str = HTTP
    headers: tuple[tuple[str, str], ...] = ()
    service_name: str = DEFAULT_SERVICE
    resource: tuple[tuple[str, str], ...] = ()
    sampler: str = "parentbased_traceidratio"
    ratio: float = 1.0

    def make_sampler(self) -> Sampler:
        from opentelemetry.sdk.trace.sampling import (
            ALWAYS_OFF,
            ALWAYS_ON,
            ParentBased,
            TraceIdRatioBased,
        )

        root: Sampler
        name = self.sampler.removeprefix("parentbased_")
        if name == "always_on":
            root = ALWAYS_ON
        elif name == "always_off":
            root = ALWAYS_OFF
        else:
            root = TraceIdRatioBased(self.ratio)
        return ParentBased(root) if self.sampler.startswith("parentbased_") else root


def resolve(settings: ObservabilitySettings, env: Mapping[str, str]) -> OtelExport:
    """The export that ``settings`` and the ``OTEL_*`` variables in ``env`` describe."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return OtelExport(endpoint=None)
    given = settings.model_fields_set
    protocol = _first(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or HTTP).strip().lower()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported; accepted: {', '.join(PROTOCOLS)}",
            param="OTEL_EXPORTER_OTLP_PROTOCOL",
        )
    endpoint = settings.otlp_endpoint or _endpoint(env, protocol)
    if endpoint and protocol == GRPC and not _grpc_exporter():
        raise ConfigError(
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
            "opentelemetry-exporter-otlp-proto-grpc; accepted here: http/protobuf",
            param="OTEL_EXPORTER_OTLP_PROTOCOL",
        )
    headers_var = (
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
        if "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in env
        else "OTEL_EXPORTER_OTLP_HEADERS"
    )
    headers = _pairs(env.get(headers_var, ""), headers_var)
    resource = dict(_pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES"))
    if "service_name" in given:
        service = settings.service_name
    else:
        service = env.get("OTEL_SERVICE_NAME") or resource.get("service.name") or DEFAULT_SERVICE
    resource.pop("service.name", None)
    if "sample_ratio" in given:
        sampler, ratio = "parentbased_traceidratio", settings.sample_ratio
    else:
        sampler, ratio = _sampler(env, settings.sample_ratio)
    return OtelExport(
        endpoint=endpoint or None,
        protocol=protocol,
        headers=headers,
        service_name=service,
        resource=tuple(sorted(resource.items())),
        sampler=sampler,
        ratio=ratio,
    )


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


def _endpoint(env: Mapping[str, str], protocol: str) -> str | None:
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    # over HTTP the base endpoint is the collector's root; each signal has its own path
    return base if protocol == GRPC else base.rstrip("/") + "/v1/traces"


def _pairs(text: str, var: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` (W3C baggage-like, values URL-encoded) as pairs; an entry without
    ``=`` or with an empty key names the variable, never its value."""
    out: list[tuple[str, str]] = []
    for entry in text.split(","):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{var}: each entry must be key=value, comma-separated", param=var)
        out.append((unquote(key.strip()), unquote(value.strip())))
    return tuple(out)


def _sampler(env: Mapping[str, str], default_ratio: float) -> tuple[str, float]:
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
    if name not in SAMPLERS:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER: unsupported; accepted: {', '.join(SAMPLERS)}",
            param="OTEL_TRACES_SAMPLER",
        )
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    if arg is None or not name.endswith("traceidratio"):
        return name, default_ratio
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            "OTEL_TRACES_SAMPLER_ARG: a ratio from 0 to 1", param="OTEL_TRACES_SAMPLER_ARG"
        )
    return name, ratio


def _grpc_exporter() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
    except ModuleNotFoundError:
        return False

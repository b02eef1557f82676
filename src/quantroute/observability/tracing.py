"""OpenTelemetry traces: an OTLP exporter when an endpoint is configured, else off.

The endpoint, protocol, headers, resource and sampler come from
``observability.*`` and the standard ``OTEL_*`` variables (:mod:`.otel`).
Off is a :class:`Tracing` whose ``tracer`` is ``None``: the SDK is never
imported and every request hook checks one attribute. On, the provider is
this object's own (the process-wide global provider is left alone), sampling
is parent-based by default (a client's ``traceparent`` decides for its own
trace; new traces are kept at ``sample_ratio``), and spans leave in batches.

Context crosses processes as W3C ``traceparent`` / ``tracestate`` and
``baggage`` headers: :meth:`extract` reads a client's, :meth:`inject` writes
them for an engine (its worker, or a remote server's HTTP headers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from quantroute.config import otel_environment
from quantroute.observability.otel import GRPC, resolve

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Tracer

    from quantroute.config import ObservabilitySettings

log = logging.getLogger(__name__)

PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


class Tracing:
    """Where the gateway's spans go. ``Tracing()`` is off.

    >>> Tracing().tracer is None
    True
    """

    def __init__(
        self,
        exporter: SpanExporter | None = None,
        *,
        service_name: str = "quantroute",
        sample_ratio: float = 1.0,
        batch: bool = True,
        sampler: Sampler | None = None,
        resource: Mapping[str, str] | None = None,
    ):
        self.tracer: Tracer | None = None
        self._provider: TracerProvider | None = None
        if exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self._provider = TracerProvider(
            resource=Resource.create({**(resource or {}), "service.name": service_name}),
            sampler=sampler or ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self.tracer = self._provider.get_tracer("quantroute")

    @classmethod
    def from_settings(
        cls, settings: ObservabilitySettings, env: Mapping[str, str] | None = None
    ) -> Tracing:
        """Tracing as ``settings`` and the ``OTEL_*`` variables (``env``, else the
        process's) say (:func:`quantroute.observability.otel.resolve`)."""
        export = resolve(settings, otel_environment() if env is None else env)
        if export.endpoint is None:
            return cls()
        exporter: SpanExporter
        if export.protocol == GRPC:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )

            exporter = GrpcExporter(endpoint=export.endpoint, headers=export.headers)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=export.endpoint, headers=dict(export.headers))
        log.info("tracing: OTLP (%s) to %s", export.protocol, export.endpoint)
        return cls(
            exporter,
            service_name=export.service_name,
            sampler=export.make_sampler(),
            resource=dict(export.resource),
        )

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context:
        """The client's trace context and baggage (an empty context when it sent none)."""
        return PROPAGATOR.extract(headers)

    @staticmethod
    def inject(context: Context) -> tuple[tuple[str, str], ...]:
        """``context`` as W3C headers, for an engine to pass on."""
        carrier: dict[str, Any] = {}
        PROPAGATOR.inject(carrier, context=context)
        return tuple(carrier.items())

    def flush(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()

    def shutdown(self) -> None:
        """Send what is left; stop the exporter (the lifespan's last step)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.tracer = None

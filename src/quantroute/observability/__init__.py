"""Observability: Prometheus metrics, OpenTelemetry traces, structured logs, the status page.

The gateway owns one :class:`Observer`; each request reports to its
:class:`RequestTrace`. See docs/observability.md.
"""

from __future__ import annotations

from quantroute.observability.instruments import Instruments
from quantroute.observability.logs import configure_logging
from quantroute.observability.metrics import GatewayCollector, GatewayView, render_metrics
from quantroute.observability.observer import Observer, RecentRequests
from quantroute.observability.requests import NULL_TRACE, RequestTrace
from quantroute.observability.tracing import Tracing

__all__ = [
    "NULL_TRACE",
    "GatewayCollector",
    "GatewayView",
    "Instruments",
    "Observer",
    "RecentRequests",
    "RequestTrace",
    "Tracing",
    "configure_logging",
    "render_metrics",
]

"""Observability: Prometheus metrics (tracing and structured logs come with their issue)."""

from __future__ import annotations

from quantroute.observability.metrics import GatewayCollector, GatewayView, render_metrics

__all__ = ["GatewayCollector", "GatewayView", "render_metrics"]

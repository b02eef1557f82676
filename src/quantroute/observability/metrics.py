"""Prometheus metrics, collected when scraped: nothing is counted on the hot path.

The collector reads the gateway's state through :class:`GatewayView` (a
protocol, so this package imports nothing above core) and exposes:

=========================================  =====  =========================================
metric                                     type   labels
=========================================  =====  =========================================
``quantroute_branch_ready``                gauge  model, branch, precision
``quantroute_branch_failed``               gauge  model, branch (failed: crashed too often,
                                                  or its file could not be loaded)
``quantroute_branch_breaker_open``        gauge  model, branch (its circuit breaker turns
                                                  requests away)
``quantroute_branch_in_flight``            gauge  model, branch
``quantroute_branch_degraded``             gauge  model, branch (the drift monitor's verdict)
``quantroute_branch_drift_window_kld``     gauge  model, branch (mean KLD of the last window)
``quantroute_branch_drift_window_top1``    gauge  model, branch
``quantroute_branch_footprint_bytes``      gauge  model, branch, device
``quantroute_device_total_bytes``          gauge  device, kind
``quantroute_device_free_bytes``           gauge  device, kind
``quantroute_device_free_for_routing_bytes``  gauge  device, kind
``quantroute_device_health``               gauge  device (exp(-λ · recent failures))
``quantroute_device_snapshot_age_seconds`` gauge  (one series)
=========================================  =====  =========================================
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class BranchSample:
    model: str
    branch: str
    precision: str
    ready: bool
    failed: bool
    breaker_open: bool
    in_flight: int
    device: str
    footprint_bytes: int
    degraded: bool
    window_kld: float | None
    window_top1: float | None


@dataclass(frozen=True, slots=True)
class DeviceSample:
    device: str
    kind: str
    total_bytes: int
    free_bytes: int
    free_for_routing_bytes: int
    health: float


class GatewayView(Protocol):
    """What the metrics read, at scrape time."""

    def branch_samples(self) -> list[BranchSample]: ...

    def device_samples(self) -> tuple[list[DeviceSample], float]: ...  # and the snapshot age


class GatewayCollector(Collector):
    def __init__(self, view: GatewayView):
        self._view = view

    def collect(self) -> Iterator[Metric]:
        branch_labels = ["model", "branch"]
        ready = GaugeMetricFamily(
            "quantroute_branch_ready",
            "Branch takes traffic (1) or not.",
            labels=[*branch_labels, "precision"],
        )
        failed = GaugeMetricFamily(
            "quantroute_branch_failed",
            "Branch is failed (1): it crashed too often or could not load; see /v1/models.",
            labels=branch_labels,
        )
        breaker = GaugeMetricFamily(
            "quantroute_branch_breaker_open",
            "The branch's circuit breaker is open (1): requests go elsewhere.",
            labels=branch_labels,
        )
        in_flight = GaugeMetricFamily(
            "quantroute_branch_in_flight", "Requests running on the branch.", labels=branch_labels
        )
        degraded = GaugeMetricFamily(
            "quantroute_branch_degraded",
            "The drift monitor marked the branch degraded (1).",
            labels=branch_labels,
        )
        kld = GaugeMetricFamily(
            "quantroute_branch_drift_window_kld",
            "Mean KLD vs the reference in the last drift window.",
            labels=branch_labels,
        )
        top1 = GaugeMetricFamily(
            "quantroute_branch_drift_window_top1",
            "Top-1 agreement with the reference in the last drift window.",
            labels=branch_labels,
        )
        footprint = GaugeMetricFamily(
            "quantroute_branch_footprint_bytes",
            "Memory the branch occupies on its device.",
            labels=[*branch_labels, "device"],
        )
        for b in self._view.branch_samples():
            ids = [b.model, b.branch]
            ready.add_metric([*ids, b.precision], float(b.ready))
            failed.add_metric(ids, float(b.failed))
            breaker.add_metric(ids, float(b.breaker_open))
            in_flight.add_metric(ids, float(b.in_flight))
            degraded.add_metric(ids, float(b.degraded))
            if b.window_kld is not None:
                kld.add_metric(ids, b.window_kld)
            if b.window_top1 is not None:
                top1.add_metric(ids, b.window_top1)
            footprint.add_metric([*ids, b.device], float(b.footprint_bytes))
        yield from (ready, failed, breaker, in_flight, degraded, kld, top1, footprint)

        devices, age = self._view.device_samples()
        labels = ["device", "kind"]
        total = GaugeMetricFamily("quantroute_device_total_bytes", "Device memory.", labels=labels)
        free = GaugeMetricFamily(
            "quantroute_device_free_bytes", "Free device memory.", labels=labels
        )
        routable = GaugeMetricFamily(
            "quantroute_device_free_for_routing_bytes",
            "Free memory less the safety margin.",
            labels=labels,
        )
        health = GaugeMetricFamily(
            "quantroute_device_health", "Device health factor in [0, 1].", labels=["device"]
        )
        for d in devices:
            total.add_metric([d.device, d.kind], float(d.total_bytes))
            free.add_metric([d.device, d.kind], float(d.free_bytes))
            routable.add_metric([d.device, d.kind], float(d.free_for_routing_bytes))
            health.add_metric([d.device], d.health)
        yield from (total, free, routable, health)
        yield GaugeMetricFamily(
            "quantroute_device_snapshot_age_seconds",
            "Age of the device reading routing uses.",
            value=age,
        )


def render_metrics(view: GatewayView) -> bytes:
    """The Prometheus text exposition of the gateway, now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(view))
    return generate_latest(registry)

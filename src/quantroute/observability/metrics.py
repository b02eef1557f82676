"""Prometheus metrics read when scraped (the counted ones are in ``instruments.py``).

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
``quantroute_branch_breaker_state``        gauge  model, branch, state (1 for the current one
                                                  of closed, open, half_open)
``quantroute_branch_profile_kld``          gauge  model, branch (profiled mean KLD vs the
                                                  reference, nats per token)
``quantroute_branch_profile_top1``         gauge  model, branch (profiled top-1 agreement)
``quantroute_branch_in_flight``            gauge  model, branch
``quantroute_branch_observed_ttft_seconds``  gauge  model, branch (routing's observed time to
                                                  first token, end to end; absent without)
``quantroute_branch_observed_decode_tokens_per_second``  gauge  model, branch (the same,
                                                  output tokens/s after the first)
``quantroute_branch_degraded``             gauge  model, branch (the drift monitor's verdict)
``quantroute_branch_drift_window_kld``     gauge  model, branch (mean KLD of the last window)
``quantroute_branch_drift_window_top1``    gauge  model, branch
``quantroute_branch_footprint_bytes``      gauge  model, branch, device
``quantroute_branch_remote_up``            gauge  model, branch (a remote branch's server
                                                  answered its last health probe)
``quantroute_branch_remote_kv_usage_ratio``  gauge  model, branch (0 to 1: how full the
                                                  remote server's KV cache is, where it says)
``quantroute_branch_remote_running_requests``  gauge  model, branch (sequences the remote
                                                  server runs, every client's)
``quantroute_branch_remote_waiting_requests``  gauge  model, branch (sequences it queues)
``quantroute_device_total_bytes``          gauge  device, kind
``quantroute_device_free_bytes``           gauge  device, kind
``quantroute_device_free_for_routing_bytes``  gauge  device, kind
``quantroute_device_used_bytes``           gauge  device, kind
``quantroute_device_free_ratio``           gauge  device, kind (free / total, 0 to 1)
``quantroute_device_utilization_ratio``    gauge  device, kind (0 to 1, where read)
``quantroute_device_temperature_celsius``  gauge  device, kind (where read)
``quantroute_device_health``               gauge  device (exp(-λ · recent failures))
``quantroute_queue_depth``                 gauge  model (requests waiting for admission)
``quantroute_model_running_requests``      gauge  model (admitted, not finished)
``quantroute_device_snapshot_age_seconds`` gauge  (one series)
=========================================  =====  =========================================

The ``remote`` families come from a remote branch's engine (``engine: openai``), read
through :func:`remote_sample`: its ``health()`` report, as its probe last saw the server.
A local branch has none of them. They are what scales a remote engine's Deployment
(deploy/kubernetes: KEDA on ``quantroute_branch_remote_kv_usage_ratio``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
    breaker_state: str = "closed"
    profile_kld: float | None = None
    profile_top1: float | None = None
    observed: ObservedSpeedLike | None = None  # routing's end-to-end speed (routing.speeds)
    remote: RemoteSample | None = None  # a remote branch's server, as last probed


@dataclass(frozen=True, slots=True)
class RemoteSample:
    """A remote branch's server as its engine's probe last saw it. The counts and the KV
    usage are ``None`` where the server does not say (no ``/metrics``, or a llama-server,
    which stopped exporting its KV cache usage in 2025)."""

    up: bool
    kv_usage: float | None = None  # 0-1
    running: int | None = None
    waiting: int | None = None


@runtime_checkable
class HealthReporting(Protocol):
    """An engine that reports on the server behind it (``OpenAIEngine.health``): a mapping
    with at least ``healthy`` (bool), ``kv_usage`` (0-1 or ``None``), ``running`` and
    ``waiting`` (counts or ``None``). Local engines have no ``health``."""

    def health(self) -> Mapping[str, object]: ...


def remote_sample(engine: object) -> RemoteSample | None:
    """What the metrics show of ``engine``'s server: ``None`` for an engine with no
    ``health()`` (a local worker, a fake), so that this package names no engine class.

    >>> class Remote:
    ...     def health(self): return {"healthy": True, "kv_usage": 0.5, "running": 3, "waiting": 0}
    >>> remote_sample(Remote())
    RemoteSample(up=True, kv_usage=0.5, running=3, waiting=0)
    >>> remote_sample(object()) is None
    True
    """
    if not isinstance(engine, HealthReporting):
        return None
    report = engine.health()
    if not isinstance(report, Mapping):  # a report of another shape shows nothing
        return None
    return RemoteSample(
        up=report.get("healthy") is True,
        kv_usage=_ratio(report.get("kv_usage")),
        running=_count(report.get("running")),
        waiting=_count(report.get("waiting")),
    )


def _ratio(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


class ObservedSpeedLike(Protocol):
    @property
    def ttft_ms(self) -> float: ...
    @property
    def decode_tps(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class DeviceSample:
    device: str
    kind: str
    total_bytes: int
    free_bytes: int
    free_for_routing_bytes: int
    health: float
    used_bytes: int = 0
    utilization: float | None = None
    temperature_c: float | None = None


@dataclass(frozen=True, slots=True)
class ModelSample:
    model: str
    queued: int
    running: int


BREAKER_STATES = ("closed", "open", "half_open")


class GatewayView(Protocol):
    """What the metrics read, at scrape time."""

    def branch_samples(self) -> list[BranchSample]: ...

    def device_samples(self) -> tuple[list[DeviceSample], float]: ...  # and the snapshot age

    def model_samples(self) -> list[ModelSample]: ...


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
        state = GaugeMetricFamily(
            "quantroute_branch_breaker_state",
            "The branch's circuit breaker is in this state (1).",
            labels=[*branch_labels, "state"],
        )
        profile_kld = GaugeMetricFamily(
            "quantroute_branch_profile_kld",
            "Profiled mean KL divergence from the reference, nats per token.",
            labels=branch_labels,
        )
        profile_top1 = GaugeMetricFamily(
            "quantroute_branch_profile_top1",
            "Profiled top-1 agreement with the reference.",
            labels=branch_labels,
        )
        observed_ttft = GaugeMetricFamily(
            "quantroute_branch_observed_ttft_seconds",
            "Time to first token as recent requests on the branch saw it (routing's estimate).",
            labels=branch_labels,
        )
        observed_tps = GaugeMetricFamily(
            "quantroute_branch_observed_decode_tokens_per_second",
            "Output tokens/s after the first as recent requests saw it (routing's estimate).",
            labels=branch_labels,
        )
        remote_up = GaugeMetricFamily(
            "quantroute_branch_remote_up",
            "The remote branch's server answered its last health probe (1) or not (0).",
            labels=branch_labels,
        )
        remote_kv = GaugeMetricFamily(
            "quantroute_branch_remote_kv_usage_ratio",
            "How full the remote branch's server's KV cache is, 0 to 1 (its own metrics).",
            labels=branch_labels,
        )
        remote_running = GaugeMetricFamily(
            "quantroute_branch_remote_running_requests",
            "Sequences the remote branch's server runs, every client's (its own metrics).",
            labels=branch_labels,
        )
        remote_waiting = GaugeMetricFamily(
            "quantroute_branch_remote_waiting_requests",
            "Sequences the remote branch's server queues, every client's (its own metrics).",
            labels=branch_labels,
        )
        for b in self._view.branch_samples():
            ids = [b.model, b.branch]
            if b.remote is not None:
                remote_up.add_metric(ids, float(b.remote.up))
                if b.remote.kv_usage is not None:
                    remote_kv.add_metric(ids, b.remote.kv_usage)
                if b.remote.running is not None:
                    remote_running.add_metric(ids, float(b.remote.running))
                if b.remote.waiting is not None:
                    remote_waiting.add_metric(ids, float(b.remote.waiting))
            if b.observed is not None:
                observed_ttft.add_metric(ids, b.observed.ttft_ms / 1000.0)
                if b.observed.decode_tps is not None:
                    observed_tps.add_metric(ids, b.observed.decode_tps)
            for name in BREAKER_STATES:
                state.add_metric([*ids, name], float(b.breaker_state == name))
            if b.profile_kld is not None:
                profile_kld.add_metric(ids, b.profile_kld)
            if b.profile_top1 is not None:
                profile_top1.add_metric(ids, b.profile_top1)
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
        yield from (state, profile_kld, profile_top1, observed_ttft, observed_tps)
        yield from (remote_up, remote_kv, remote_running, remote_waiting)

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
        used = GaugeMetricFamily(
            "quantroute_device_used_bytes", "Used device memory.", labels=labels
        )
        util = GaugeMetricFamily(
            "quantroute_device_utilization_ratio",
            "Device busy fraction, 0 to 1.",
            labels=labels,
        )
        temperature = GaugeMetricFamily(
            "quantroute_device_temperature_celsius", "Device temperature.", labels=labels
        )
        free_ratio = GaugeMetricFamily(
            "quantroute_device_free_ratio",
            "Free device memory / device memory, 0 to 1.",
            labels=labels,
        )
        for d in devices:
            if d.total_bytes > 0:
                ratio = min(1.0, max(0.0, d.free_bytes / d.total_bytes))
                free_ratio.add_metric([d.device, d.kind], ratio)
            used.add_metric([d.device, d.kind], float(d.used_bytes))
            if d.utilization is not None:
                util.add_metric([d.device, d.kind], d.utilization)
            if d.temperature_c is not None:
                temperature.add_metric([d.device, d.kind], d.temperature_c)
            total.add_metric([d.device, d.kind], float(d.total_bytes))
            free.add_metric([d.device, d.kind], float(d.free_bytes))
            routable.add_metric([d.device, d.kind], float(d.free_for_routing_bytes))
            health.add_metric([d.device], d.health)
        yield from (total, free, routable, health, used, util, temperature, free_ratio)
        queued = GaugeMetricFamily(
            "quantroute_queue_depth",
            "Requests waiting in the model's admission queue.",
            labels=["model"],
        )
        running = GaugeMetricFamily(
            "quantroute_model_running_requests",
            "Requests of the model admitted and not finished.",
            labels=["model"],
        )
        for m in self._view.model_samples():
            queued.add_metric([m.model], float(m.queued))
            running.add_metric([m.model], float(m.running))
        yield from (queued, running)
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

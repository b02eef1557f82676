"""Read-only views of the gateway: ``GET /v1/devices`` and the Prometheus metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from quantroute.api.gateway import Gateway
from quantroute.observability.metrics import BranchSample, DeviceSample
from quantroute.telemetry import snapshot_to_json


def devices_json(gateway: Gateway) -> dict[str, Any]:
    """The body of ``GET /v1/devices``: the latest snapshot, and each branch's placement."""
    assert gateway.poller is not None
    snapshot = gateway.poller.snapshot
    on_device: dict[str, list[str]] = {}
    for branch_id, placement in gateway.placements.items():
        if placement.device is not None:
            on_device.setdefault(placement.device, []).append(branch_id)
    body = snapshot_to_json(
        snapshot,
        on_device,
        health=gateway.health.factors(snapshot.device_ids),
        margin=gateway.margin,
    )
    body["branches"] = {
        branch_id: {
            "device": p.device,
            "ready": _ready(gateway, branch_id),
            "footprint": {
                "bytes": p.footprint.bytes,
                "device_bytes": gateway.device_bytes(p.footprint),
                "estimated_bytes": p.footprint.estimated_bytes,
                "measured_bytes": p.footprint.measured_bytes,
                "weights_bytes": p.footprint.weights_bytes,
                "kv_bytes": p.footprint.kv_bytes,
                "compute_bytes": p.footprint.compute_bytes,
                "overhead_bytes": p.footprint.overhead_bytes + p.footprint.runtime_bytes,
            },
        }
        for branch_id, p in gateway.placements.items()
    }
    return body


@dataclass(frozen=True, slots=True)
class MetricsView:
    """The gateway as :class:`quantroute.observability.GatewayView` reads it."""

    gateway: Gateway

    def branch_samples(self) -> list[BranchSample]:
        gateway = self.gateway
        samples = []
        for b in gateway.routes.current.branches():
            placement = gateway.placements.get(b.id)
            state = gateway.drift.state(b.id) if gateway.drift is not None else None
            last = state.last if state is not None else None
            samples.append(
                BranchSample(
                    model=b.model,
                    branch=b.name,
                    precision=b.precision.value,
                    ready=gateway.routable(b),
                    in_flight=b.engine.in_flight,
                    device=(placement.device or "") if placement else "",
                    footprint_bytes=gateway.device_bytes(placement.footprint) if placement else 0,
                    degraded=bool(state and state.degraded),
                    window_kld=last.mean_kld if last else None,
                    window_top1=last.top1 if last else None,
                )
            )
        return samples

    def device_samples(self) -> tuple[list[DeviceSample], float]:
        gateway = self.gateway
        if gateway.poller is None:
            return [], math.inf
        snapshot = gateway.poller.snapshot
        return [
            DeviceSample(
                device=d.id,
                kind=str(d.kind),
                total_bytes=d.total_bytes,
                free_bytes=d.free_bytes,
                free_for_routing_bytes=gateway.margin.headroom(d),
                health=gateway.health.factor(d.id),
            )
            for d in snapshot.devices
        ], snapshot.age_s()


def _ready(gateway: Gateway, branch_id: str) -> bool:
    return any(gateway.routable(b) for b in gateway.routes.current.branches() if b.id == branch_id)

"""Read-only views of the gateway: the bodies of ``GET /v1/models``, ``/v1/devices``,
``/readyz`` and ``/admin/status``, and the Prometheus metrics. The service calls these;
routes never do. Each reads the parts a :class:`ViewSources` names (the composition
root builds it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from quantroute.api.profiles import profile_json, profile_state
from quantroute.cluster import ClusterState
from quantroute.engines.base import PromptCacheStats
from quantroute.engines.llamacpp.build import probe_build
from quantroute.errors import EngineError, NotFoundError
from quantroute.observability import Observer
from quantroute.observability.metrics import (
    BranchSample,
    DeviceSample,
    ModelSample,
    remote_sample,
)
from quantroute.quality.drift import DriftMonitor
from quantroute.resilience import OPEN, Admission, Breakers, BreakerState, RetryBudget, Tenant
from quantroute.routing.residency import Residency
from quantroute.routing.speeds import ObservedSpeeds
from quantroute.routing.table import Branch, RouteTableRef
from quantroute.telemetry import (
    DevicePoller,
    HealthTracker,
    MarginPolicy,
    Occupancy,
    snapshot_to_json,
)


@dataclass(frozen=True, slots=True)
class ViewSources:
    """What the views read: the gateway's parts, read when a view is asked for."""

    routes: RouteTableRef
    occupancy: Occupancy
    residency: Residency
    speeds: ObservedSpeeds  # each branch's observed speed
    drift: Callable[[], DriftMonitor]  # the one serving now: a reload replaces it
    breakers: Breakers
    retry_budget: RetryBudget
    admission: Admission
    poller: DevicePoller
    health: HealthTracker
    margin: MarginPolicy
    observer: Observer  # renders the metrics
    superseded: Mapping[str, str]  # branch id -> why its worker stays down
    answered: Mapping[str, int]  # model@version -> requests it answered
    repository: Callable[[], dict[str, Any]]  # the reloader's part of /admin/status
    cluster: ClusterState  # drains, traffic rules, tenants: the fleet's (its status, metrics)
    redis: Callable[[], dict[str, Any] | None]  # the fleet's Redis, as /admin/status shows it


def branch_state(parts: ViewSources, branch: Branch) -> tuple[str, str | None]:
    """``(state, why)``: ``ready``, ``starting``, ``draining``, ``drained`` (by an operator),
    ``unloaded`` or ``failed`` (with the cause in words)."""
    placement = parts.occupancy.get(branch.id)
    if placement is not None and placement.problem:
        return "failed", placement.problem
    if branch.engine.failure:
        return "failed", branch.engine.failure
    if not branch.engine.ready and branch.id in parts.superseded:
        return "failed", parts.superseded[branch.id]
    if parts.residency.draining(branch.id):
        return "draining", None
    if parts.residency.drained(branch.id):
        return "drained", None
    if parts.residency.routable(branch):
        return "ready", None
    if branch.engine.model_path is not None and not parts.residency.loaded(branch.id):
        return "unloaded", None
    return "starting", None


def models_json(parts: ViewSources, tenant: Tenant = OPEN) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for route in parts.routes.current.models.values():
        if not tenant.may_use(route.model):
            continue
        branches = []
        for b in route.branches:
            state, why = branch_state(parts, b)
            branches.append(
                {
                    "id": b.id,
                    "branch": b.name,
                    "precision": b.precision.value,
                    "engine": b.artifact.engine,
                    "reference": b.name == route.reference,
                    "ready": state == "ready",
                    "state": state,
                    "failure": why,
                    "sha256": b.artifact.sha256,
                    "size_bytes": b.artifact.size_bytes,
                    "n_ctx": b.engine.info.n_ctx if b.engine.info else None,
                    "in_flight": b.engine.in_flight,
                    "prompt_cache": _prompt_cache_json(b.engine.prompt_cache),
                    "profile": profile_json(b.profile),
                    "profile_state": profile_state(b.profile, b.name in route.stale),
                    "drift": _drift_json(parts, b.id),
                    "observed_speed": parts.speeds.to_json(b.id),
                }
            )
        data.append(
            {
                "id": route.name,
                "object": "model",
                "created": 0,
                "owned_by": "quantroute",
                "reference": route.reference,
                "version": route.version,
                "branches": branches,
                "profile_warnings": list(route.profile_warnings),
            }
        )
        data += [
            {
                "id": b["id"],
                "object": "model",
                "created": 0,
                "owned_by": "quantroute",
                "parent": route.name,
            }
            for b in branches
        ]
    for split in parts.routes.current.splits.values():
        if tenant.may_use(split.model):
            data.append(
                {
                    "id": split.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "quantroute",
                    "versions": list(split.versions),
                    "default_version": split.default,
                    "traffic": [
                        {k: v for k, v in asdict(r).items() if v is not None} for r in split.rules
                    ],
                }
            )
    return {"object": "list", "data": data}


def _prompt_cache_json(stats: PromptCacheStats | None) -> dict[str, Any] | None:
    """The branch's prompt cache: reused tokens / prompt tokens since its engine started."""
    if stats is None:
        return None
    return {
        "enabled": stats.enabled,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "hit_rate": stats.hit_rate,
    }


def model_json(parts: ViewSources, model_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
    """The body of ``GET /v1/models/{id}``: one entry of :func:`models_json` (a model or a
    pinned branch id); 404 for an unknown one, or one ``tenant`` may not use."""
    for entry in models_json(parts, tenant)["data"]:
        if entry["id"] == model_id:
            return dict(entry)
    raise NotFoundError("The requested model does not exist.", param="model")


def readiness_json(parts: ViewSources) -> tuple[bool, dict[str, Any]]:
    ready: dict[str, list[str]] = {}
    failed: dict[str, dict[str, str]] = {}
    for name, route in parts.routes.current.models.items():
        ready[name] = []
        for b in route.branches:
            state, why = branch_state(parts, b)
            if state == "ready":
                ready[name].append(b.name)
            elif state == "failed":
                failed.setdefault(name, {})[b.name] = why or "failed"
    ok = bool(ready) and all(ready.values())
    body: dict[str, Any] = {"status": "ready" if ok else "not ready", "ready_branches": ready}
    body["failed_branches"] = failed
    return ok, body


def status_json(parts: ViewSources) -> dict[str, Any]:
    now = time.monotonic()
    branches = {}
    for b in parts.routes.current.branches():
        state, why = branch_state(parts, b)
        breaker = parts.breakers.get(b.id)
        breaker_state = breaker.state(now)
        branches[b.id] = {
            "state": state,
            "failure": why,
            "in_flight": b.engine.in_flight,
            "breaker": {
                "state": breaker_state.value,
                "failures_in_a_row": breaker.failures,
                "opens": breaker.opens,
                "open_for_s": max(0.0, breaker.open_until() - now)
                if breaker_state is BreakerState.OPEN
                else 0.0,
            },
        }
    budget = parts.retry_budget
    return {
        "branches": branches,
        "retry_budget": {
            "active_requests": budget.active,
            "retries_in_flight": budget.retrying,
            "limit": budget.limit,
            "refused": budget.refused,
        },
        "repository": parts.repository(),
        "versions_answered": dict(parts.answered),
        "cluster": parts.cluster.status_json(),
        "redis": parts.redis(),
    }


def _drift_json(parts: ViewSources, branch_id: str) -> dict[str, Any] | None:
    state = parts.drift().state(branch_id)
    last = state.last
    return {
        "degraded": state.degraded,
        "windows": state.windows,
        "replays": state.replays,
        "dropped": state.dropped,
        "last_window": None
        if last is None
        else {
            "mean_kld": last.mean_kld,
            "top1": last.top1,
            "tokens": last.n_tokens,
            "in_bounds": last.in_bounds,
        },
    }


def devices_json(parts: ViewSources) -> dict[str, Any]:
    """The latest snapshot, and each branch's placement and footprint."""
    snapshot = parts.poller.snapshot
    occupancy = parts.occupancy
    on_device: dict[str, list[str]] = {}
    for branch_id, placement in occupancy.placements.items():
        if placement.device is not None:
            on_device.setdefault(placement.device, []).append(branch_id)
    body = snapshot_to_json(
        snapshot,
        on_device,
        health=parts.health.factors(snapshot.device_ids),
        margin=parts.margin,
    )
    states = {b.id: branch_state(parts, b) for b in parts.routes.current.branches()}
    body["branches"] = {
        branch_id: {
            "device": p.device,
            "ready": states.get(branch_id, ("", None))[0] == "ready",
            "state": states.get(branch_id, ("unknown", None))[0],
            "failure": states.get(branch_id, ("", None))[1],
            "n_gpu_layers": p.n_gpu_layers if p.gpu is not None else 0,
            "footprint": {
                "bytes": p.footprint.bytes,
                "device_bytes": occupancy.device_bytes(p.footprint),
                "estimated_bytes": p.footprint.estimated_bytes,
                "measured_bytes": p.footprint.measured_bytes,
                "weights_bytes": p.footprint.weights_bytes,
                "kv_bytes": p.footprint.kv_bytes,
                "compute_bytes": p.footprint.compute_bytes,
                "overhead_bytes": p.footprint.overhead_bytes + p.footprint.runtime_bytes,
            },
        }
        for branch_id, p in occupancy.placements.items()
    }
    body["data"].extend(_remote_devices(parts, on_device))
    return body


def _remote_devices(parts: ViewSources, on_device: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One entry per remote server (kind ``remote``): its health and load as its
    branch's engine last probed them."""
    out: dict[str, dict[str, Any]] = {}
    for b in parts.routes.current.branches():
        device = b.artifact.device
        health = getattr(b.engine, "health", None)
        if device is None or not device.startswith("remote:") or health is None:
            continue
        h = health()
        entry = out.setdefault(
            device,
            {"id": device, "kind": "remote", "url": h["url"], "server": h["server"]},
        )
        entry["healthy"] = entry.get("healthy", True) and h["healthy"]
        for key in ("down_since_s", "reason", "running", "waiting", "kv_usage"):
            entry[key] = h[key] if entry.get(key) is None else entry[key]
        entry["in_flight"] = entry.get("in_flight", 0) + h["in_flight"]
        entry["branches"] = on_device.get(device, [])
    return list(out.values())


@dataclass(frozen=True, slots=True)
class MetricsView:
    """The gateway as :class:`quantroute.observability.GatewayView` reads it."""

    parts: ViewSources

    def branch_samples(self) -> list[BranchSample]:
        parts = self.parts
        samples, now = [], time.monotonic()
        drift = parts.drift()
        for b in parts.routes.current.branches():
            placement = parts.occupancy.get(b.id)
            state = drift.state(b.id)
            last = state.last
            samples.append(
                BranchSample(
                    model=b.model,
                    branch=b.name,
                    precision=b.precision.value,
                    ready=parts.residency.routable(b),
                    failed=branch_state(parts, b)[0] == "failed",
                    breaker_open=parts.breakers.is_open(b.id),
                    in_flight=b.engine.in_flight,
                    device=(placement.device or "") if placement else "",
                    footprint_bytes=(
                        parts.occupancy.device_bytes(placement.footprint) if placement else 0
                    ),
                    degraded=state.degraded,
                    window_kld=last.mean_kld if last else None,
                    window_top1=last.top1 if last else None,
                    breaker_state=parts.breakers.get(b.id).state(now).value,
                    profile_kld=b.profile.mean_kld if b.profile else None,
                    profile_top1=b.profile.top1 if b.profile else None,
                    observed=parts.speeds.get(b.id),
                    remote=remote_sample(b.engine),
                )
            )
        return samples

    def device_samples(self) -> tuple[list[DeviceSample], float]:
        parts = self.parts
        snapshot = parts.poller.snapshot
        return [
            DeviceSample(
                device=d.id,
                kind=str(d.kind),
                total_bytes=d.total_bytes,
                free_bytes=d.free_bytes,
                free_for_routing_bytes=parts.margin.headroom(d),
                health=parts.health.factor(d.id),
                used_bytes=d.used_bytes,
                utilization=d.utilization,
                temperature_c=d.temperature_c,
            )
            for d in snapshot.devices
        ], snapshot.age_s()

    def model_samples(self) -> list[ModelSample]:
        admission = self.parts.admission
        return [
            ModelSample(name, admission.waiting(name), admission.running(name))
            for name in self.parts.routes.current.models
        ]


def metrics_text(parts: ViewSources) -> bytes:
    return parts.observer.render(MetricsView(parts)) + parts.cluster.metrics_text()


def llama_build() -> dict[str, str]:
    """The llama.cpp build the workers load, read by a child process (``probe_build``);
    ``unknown`` where the probe fails (the reason is logged)."""
    try:
        b = probe_build()
    except EngineError as exc:
        logging.getLogger(__name__).warning("the llama.cpp build probe: %s", exc)
        return {"llama_cpp": "unknown", "llama_cpp_python": "unknown"}
    return {"llama_cpp": b.ggml_commit or "unknown", "llama_cpp_python": b.llama_cpp_python}

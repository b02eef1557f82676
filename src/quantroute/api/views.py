"""Read-only views of the gateway: the bodies of ``GET /v1/models``, ``/v1/devices`` and
``/readyz``, and the Prometheus metrics. The service calls these; routes never do."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from quantroute.engines.base import PromptCacheStats
from quantroute.engines.llamacpp.build import probe_build
from quantroute.errors import EngineError, NotFoundError
from quantroute.observability.metrics import BranchSample, DeviceSample, ModelSample
from quantroute.quality.profile import BranchProfile
from quantroute.resilience import OPEN, BreakerState, Tenant
from quantroute.routing.table import Branch
from quantroute.telemetry import snapshot_to_json

if TYPE_CHECKING:
    from quantroute.api.gateway import Gateway


def branch_state(gateway: Gateway, branch: Branch) -> tuple[str, str | None]:
    """``(state, why)``: ``ready``, ``starting``, ``draining``, ``unloaded`` or ``failed``
    (with the cause in words)."""
    placement = gateway.occupancy.get(branch.id)
    if placement is not None and placement.problem:
        return "failed", placement.problem
    if branch.engine.failure:
        return "failed", branch.engine.failure
    if not branch.engine.ready and branch.id in gateway.superseded:
        return "failed", gateway.superseded[branch.id]
    if gateway.residency.draining(branch.id):
        return "draining", None
    if gateway.residency.routable(branch):
        return "ready", None
    if branch.engine.model_path is not None and not gateway.residency.loaded(branch.id):
        return "unloaded", None
    return "starting", None


def models_json(gateway: Gateway, tenant: Tenant = OPEN) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for route in gateway.routes.current.models.values():
        if not tenant.may_use(route.model):
            continue
        branches = []
        for b in route.branches:
            state, why = branch_state(gateway, b)
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
                    "profile": _profile_json(b.profile),
                    "profile_state": "stale"
                    if b.name in route.stale
                    else ("measured" if b.profile else "unprofiled"),
                    "drift": _drift_json(gateway, b.id),
                    "observed_speed": gateway.states.speeds.to_json(b.id),
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
    for split in gateway.routes.current.splits.values():
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


def model_json(gateway: Gateway, model_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
    """The body of ``GET /v1/models/{id}``: one entry of :func:`models_json` (a model or a
    pinned branch id); 404 for an unknown one, or one ``tenant`` may not use."""
    for entry in models_json(gateway, tenant)["data"]:
        if entry["id"] == model_id:
            return dict(entry)
    raise NotFoundError("The requested model does not exist.", param="model")


def readiness_json(gateway: Gateway) -> tuple[bool, dict[str, Any]]:
    ready: dict[str, list[str]] = {}
    failed: dict[str, dict[str, str]] = {}
    for name, route in gateway.routes.current.models.items():
        ready[name] = []
        for b in route.branches:
            state, why = branch_state(gateway, b)
            if state == "ready":
                ready[name].append(b.name)
            elif state == "failed":
                failed.setdefault(name, {})[b.name] = why or "failed"
    ok = bool(ready) and all(ready.values())
    body: dict[str, Any] = {"status": "ready" if ok else "not ready", "ready_branches": ready}
    body["failed_branches"] = failed
    return ok, body


def status_json(gateway: Gateway) -> dict[str, Any]:
    now = time.monotonic()
    branches = {}
    for b in gateway.routes.current.branches():
        state, why = branch_state(gateway, b)
        breaker = gateway.breakers.get(b.id)
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
    budget = gateway.retry_budget
    return {
        "branches": branches,
        "retry_budget": {
            "active_requests": budget.active,
            "retries_in_flight": budget.retrying,
            "limit": budget.limit,
            "refused": budget.refused,
        },
        "repository": gateway.reloader.status(),
        "versions_answered": dict(gateway.answered),
    }


def _drift_json(gateway: Gateway, branch_id: str) -> dict[str, Any] | None:
    state = gateway.drift.state(branch_id)
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


def _profile_json(profile: BranchProfile | None) -> dict[str, Any] | None:
    if profile is None:
        return None
    q = profile.quality
    return {
        "mean_kld": q.mean_kld,
        "kld_stderr": q.kld_stderr,
        "kld_p99": q.kld_p99,
        "top1": q.top1,
        "top1_sigma": q.top1_sigma,
        "ppl": q.ppl_q,
        "ln_ppl_ratio": q.ln_ppl_ratio,
        "rms_dp": q.rms_dp,
        "n_tokens": q.n_tokens,
        "decode_tps": profile.decode_tps,
        "prefill_tps": profile.prefill_tps,
        "rss_bytes": profile.rss_bytes,
        "measured_at": profile.measured_at.isoformat(),
    }


def devices_json(gateway: Gateway) -> dict[str, Any]:
    """The latest snapshot, and each branch's placement and footprint."""
    snapshot = gateway.poller.snapshot
    occupancy = gateway.occupancy
    on_device: dict[str, list[str]] = {}
    for branch_id, placement in occupancy.placements.items():
        if placement.device is not None:
            on_device.setdefault(placement.device, []).append(branch_id)
    body = snapshot_to_json(
        snapshot,
        on_device,
        health=gateway.health.factors(snapshot.device_ids),
        margin=gateway.margin,
    )
    states = {b.id: branch_state(gateway, b) for b in gateway.routes.current.branches()}
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
    return body


@dataclass(frozen=True, slots=True)
class MetricsView:
    """The gateway as :class:`quantroute.observability.GatewayView` reads it."""

    gateway: Gateway

    def branch_samples(self) -> list[BranchSample]:
        gateway = self.gateway
        samples, now = [], time.monotonic()
        for b in gateway.routes.current.branches():
            placement = gateway.occupancy.get(b.id)
            state = gateway.drift.state(b.id)
            last = state.last
            samples.append(
                BranchSample(
                    model=b.model,
                    branch=b.name,
                    precision=b.precision.value,
                    ready=gateway.residency.routable(b),
                    failed=branch_state(gateway, b)[0] == "failed",
                    breaker_open=gateway.breakers.is_open(b.id),
                    in_flight=b.engine.in_flight,
                    device=(placement.device or "") if placement else "",
                    footprint_bytes=(
                        gateway.occupancy.device_bytes(placement.footprint) if placement else 0
                    ),
                    degraded=state.degraded,
                    window_kld=last.mean_kld if last else None,
                    window_top1=last.top1 if last else None,
                    breaker_state=gateway.breakers.get(b.id).state(now).value,
                    profile_kld=b.profile.mean_kld if b.profile else None,
                    profile_top1=b.profile.top1 if b.profile else None,
                    observed=gateway.states.speeds.get(b.id),
                )
            )
        return samples

    def device_samples(self) -> tuple[list[DeviceSample], float]:
        gateway = self.gateway
        snapshot = gateway.poller.snapshot
        return [
            DeviceSample(
                device=d.id,
                kind=str(d.kind),
                total_bytes=d.total_bytes,
                free_bytes=d.free_bytes,
                free_for_routing_bytes=gateway.margin.headroom(d),
                health=gateway.health.factor(d.id),
                used_bytes=d.used_bytes,
                utilization=d.utilization,
                temperature_c=d.temperature_c,
            )
            for d in snapshot.devices
        ], snapshot.age_s()

    def model_samples(self) -> list[ModelSample]:
        admission = self.gateway.admission
        return [
            ModelSample(name, admission.waiting(name), admission.running(name))
            for name in self.gateway.routes.current.models
        ]


def metrics_text(gateway: Gateway) -> bytes:
    return gateway.observer.render(MetricsView(gateway))


def llama_build() -> dict[str, str]:
    """The llama.cpp build the workers load, read by a child process (``probe_build``);
    ``unknown`` where the probe fails (the reason is logged)."""
    try:
        b = probe_build()
    except EngineError as exc:
        logging.getLogger(__name__).warning("the llama.cpp build probe: %s", exc)
        return {"llama_cpp": "unknown", "llama_cpp_python": "unknown"}
    return {"llama_cpp": b.ggml_commit or "unknown", "llama_cpp_python": b.llama_cpp_python}

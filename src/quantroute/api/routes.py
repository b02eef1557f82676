"""HTTP routes: parse, call the service, render. Nothing else lives here."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantroute.api.gateway import Gateway
from quantroute.api.render import ResponseRenderer
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.service import CompletionService, Run, Tick
from quantroute.api.sse import sse_events
from quantroute.api.views import MetricsView, devices_json
from quantroute.engines.base import StartEvent
from quantroute.errors import InvalidRequestError
from quantroute.observability import render_metrics
from quantroute.quality.profile import BranchProfile
from quantroute.routing.table import RouteTableRef

router = APIRouter()


def _service(request: Request) -> CompletionService:
    service: CompletionService = request.app.state.service
    return service


def _headers(run: Run) -> dict[str, str]:
    return {
        "x-quantroute-branch": run.branch.id,
        "x-quantroute-route-reason": run.job.decision.reason,
        "x-request-id": run.job.id,
    }


async def _respond(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Any:
    service = _service(request)
    job = await service.prepare(body, request.headers)
    run = await service.start(job)
    if job.stream:
        keepalive_s = request.app.state.settings.server.keepalive_s
        return StreamingResponse(
            sse_events(run, keepalive_s),
            media_type="text/event-stream",
            headers=_headers(run) | {"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    renderer = ResponseRenderer(run)
    collect = asyncio.create_task(_collect(run, renderer))
    watch = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client left: stop generating for it
            collect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collect
    return JSONResponse(renderer.whole(), headers=_headers(run))


async def _collect(run: Run, renderer: ResponseRenderer) -> None:
    async for item in run.events():
        if isinstance(item, Tick):
            continue
        index, event = item
        if not isinstance(event, StartEvent):
            renderer.add(index, event)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Any:
    return await _respond(request, body)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest) -> Any:
    return await _respond(request, body)


@router.post("/v1/route/explain")
async def route_explain(request: Request) -> dict[str, Any]:
    """The routing decision for a chat or text completion body, without running it."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError("The request body is not valid JSON.") from exc
    schema: type[ChatCompletionRequest | CompletionRequest] = (
        ChatCompletionRequest
        if isinstance(data, dict) and "messages" in data
        else CompletionRequest
    )
    try:
        body = schema.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    return _service(request).explain(body, request.headers)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    routes: RouteTableRef = request.app.state.routes
    gateway: Gateway = request.app.state.gateway
    data: list[dict[str, Any]] = []
    for route in routes.current.models.values():
        branches = [
            {
                "id": b.id,
                "branch": b.name,
                "precision": b.precision.value,
                "engine": b.artifact.engine,
                "reference": b.name == route.reference,
                "ready": b.engine.ready,
                "sha256": b.artifact.sha256,
                "size_bytes": b.artifact.size_bytes,
                "n_ctx": b.engine.info.n_ctx if b.engine.info else None,
                "profile": _profile_json(b.profile),
                "drift": _drift_json(gateway, b.id),
            }
            for b in route.branches
        ]
        data.append(
            {
                "id": route.name,
                "object": "model",
                "created": 0,
                "owned_by": "quantroute",
                "reference": route.reference,
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
    return {"object": "list", "data": data}


def _drift_json(gateway: Gateway, branch_id: str) -> dict[str, Any] | None:
    if gateway.drift is None:
        return None
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


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics of branches and devices (text exposition format)."""
    gateway: Gateway = request.app.state.gateway
    return Response(render_metrics(MetricsView(gateway)), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    routes: RouteTableRef = request.app.state.routes
    models = {
        name: [b.name for b in route.branches if b.engine.ready]
        for name, route in routes.current.models.items()
    }
    ready = bool(models) and all(models.values())
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "ready_branches": models},
        status_code=200 if ready else 503,
    )


@router.get("/v1/devices")
async def devices(request: Request) -> dict[str, Any]:
    gateway: Gateway = request.app.state.gateway
    return devices_json(gateway)


class PressureBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    bytes: int = Field(ge=0, le=1 << 50)


@router.put("/admin/devices/{device_id}/pressure")
async def set_pressure(request: Request, device_id: str, body: PressureBody) -> dict[str, Any]:
    """Simulated devices only: occupy ``bytes`` of a device, as another tenant would."""
    gateway: Gateway = request.app.state.gateway
    gateway.set_pressure(device_id, body.bytes)
    return {"device": device_id, "pressure_bytes": body.bytes}

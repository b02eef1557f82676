"""HTTP routes: parse, call the service, render. Nothing else lives here.

The two generation endpoints, the hot path, are one ASGI layer in front of the
router (:class:`GenerationRoutes`); the rest are FastAPI routes."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from quantroute.api.auth import (
    explainer,
    is_open,
    require_admin,
    require_client,
    require_operator,
    require_reader,
    sees_everyone,
    sees_everything,
    sees_request_ids,
)
from quantroute.api.errors import render_error
from quantroute.api.render import ResponseRenderer
from quantroute.api.run import Run, Tick
from quantroute.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    parse_generation_body,
)
from quantroute.api.service import Service
from quantroute.api.sse import EventStreamResponse, payloads, write_inline
from quantroute.engines.base import StartEvent
from quantroute.errors import InvalidRequestError
from quantroute.observability.dashboard import DASHBOARD_HEADERS, DASHBOARD_HTML
from quantroute.resilience.resume import Stream, StreamStore
from quantroute.resilience.tenants import Tenant
from quantroute.tasks import cancel_and_wait

router = APIRouter()
Client = Annotated[Tenant, Depends(require_client)]  # the tenant of the request's key
Reader = Annotated[Tenant, Depends(require_reader)]  # a client's tenant, or the admin: all
STREAM_TOKEN = "x-quantroute-stream-token"  # a stream's secret: its first response has it


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _headers(run: Run) -> dict[str, str]:
    headers = {
        "x-quantroute-branch": run.branch.id,
        "x-quantroute-route-reason": run.job.decision.reason,
        "x-quantroute-artifact": run.branch.artifact.sha256[:16],  # the exact file that answered
        "x-request-id": run.job.id,
    }
    if run.branch.version is not None:
        headers["x-quantroute-version"] = run.branch.version
    draft = run.branch.draft  # a reference that speculates: the draft it drafts with
    if draft is not None and run.drafted:  # as its worker said when it started the request
        headers["x-quantroute-draft"] = draft
    return headers


async def _respond(
    request: Request, body: ChatCompletionRequest | CompletionRequest, tenant: Tenant
) -> Any:
    service = _service(request)
    job = await service.prepare(body, request.headers, tenant)
    run = await service.start(job)
    if job.stream:
        settings = request.app.state.settings.streams
        resumable = request.headers.get("x-quantroute-resumable")
        if resumable is None:
            keep_going = settings.resumable_by_default
        else:
            keep_going = resumable.strip().lower() in ("1", "true", "yes", "on")
        renderer = ResponseRenderer(run)
        first, rest = payloads(run, renderer)
        stream = _streams(request).open(
            job.id,
            tenant.name,
            rest,
            close=run.close,
            grace_s=settings.resume_grace_s if keep_going else 0.0,
            headers=_headers(run),
            first=first,
            stall_timeout_s=request.app.state.settings.resilience.reader_stall_timeout_s,
        )
        write_inline(run, renderer, stream)
        return _sse(request, stream, None, {STREAM_TOKEN: stream.token})
    renderer = ResponseRenderer(run)
    collect = asyncio.create_task(_collect(run, renderer))
    watch = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client left, or this handler is cancelled: stop generating
            await cancel_and_wait(collect)
    if not collect.cancelled():
        collect.result()  # an error it ended with is the request's
    return JSONResponse(renderer.whole(), headers=_headers(run))


def _streams(request: Request) -> StreamStore:
    """The gateway's stream store (``app.state.streams``; made here on first use when
    the app did not make one)."""
    state = request.app.state
    store: StreamStore | None = getattr(state, "streams", None)
    if store is None:
        store = state.streams = StreamStore(state.settings.streams)
    return store


def _sse(
    request: Request, stream: Stream, after: int | None, more: dict[str, str] | None = None
) -> EventStreamResponse:
    keepalive_s = request.app.state.settings.server.keepalive_s
    headers = stream.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return EventStreamResponse(stream, after, keepalive_s, headers | more if more else headers)


def _resume_after(
    stream_id: str, last_event_id: str | None, starting_after: int | None
) -> int | None:
    """The seq a resume starts after: ``Last-Event-ID`` (``<id>/<seq>``, or a bare seq)
    first, as an EventSource sends it on reconnecting, else ``starting_after``."""
    if last_event_id is None:
        return starting_after
    key, _, seq = last_event_id.strip().rpartition("/")
    if (key and key != stream_id) or len(last_event_id) > 256:
        raise InvalidRequestError(
            "Last-Event-ID is not an event id of this stream", param="Last-Event-ID"
        )
    return _seq(seq, "Last-Event-ID")


def _seq(text: str | None, param: str) -> int | None:
    """An event's seq as a client wrote it: ASCII digits only (``str.isdigit`` also takes
    digits ``int`` refuses, such as ``²``), at most 18 of them."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise InvalidRequestError(f"{param} is not an event id of this stream", param=param)
    return int(text)


@router.get("/v1/streams/{stream_id}")
async def resume_stream(
    request: Request,
    stream_id: str,
    tenant: Client,
    starting_after: Annotated[str | None, Query()] = None,
    last_event_id: Annotated[str | None, Header()] = None,
    x_quantroute_stream_token: Annotated[str | None, Header()] = None,
) -> EventStreamResponse:
    """A stream again, from the event after ``Last-Event-ID`` (or ``starting_after``):
    the events kept, then the live rest; 404 once it expired, for another tenant, or,
    with an open API, without the stream's secret (``x-quantroute-stream-token``)."""
    key = stream_id.removeprefix("chatcmpl-").removeprefix("cmpl-")  # a chunk's id works too
    after = _resume_after(key, last_event_id, _seq(starting_after, "starting_after"))
    token = x_quantroute_stream_token
    stream = await _streams(request).find(  # this gateway's, else the fleet's copy (Redis)
        key, tenant.name, after, token=token, token_required=is_open(request)
    )
    if after is not None and after >= stream.next_seq:  # no client can have seen it
        raise InvalidRequestError(
            "that event id is past this stream's last event",
            param="Last-Event-ID" if last_event_id is not None else "starting_after",
        )
    return _sse(request, stream, after)


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


_GENERATION: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


class GenerationRoutes:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` without FastAPI's
    router, dependency injection and inner middlewares, which cost more than the rest
    of a request's gateway path together (docs/benchmarks.md, "The request path").

    The same parts answer as in a route: the tenant of the key (``require_client``,
    before the body is read), the body (``parse_body``, as JSON: the gate in front,
    ``api/gate.py``, let through only a JSON content type or an ``Authorization`` header;
    the schema's errors as 400s naming the field), :func:`_respond`, and the error
    handlers' rendering (``render_error``). It sits inside the body limit and the
    internal-error middleware, which apply to it as to every route."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        schema = _GENERATION.get(scope["path"]) if scope["type"] == "http" else None
        if schema is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            if request.method != "POST":
                raise HTTPException(405, headers={"Allow": "POST"})
            tenant = await require_client(request)
            try:
                body = parse_body(await request.body(), schema)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from exc
            response = await _respond(request, body, tenant)
        except Exception as exc:
            answer = render_error(exc, request.method, scope["path"])
            if answer is None:
                raise  # a bug: the internal-error middleware answers it
            response = answer
        await response(scope, receive, send)


@router.post("/v1/route/explain")
async def route_explain(
    request: Request, tenant: Annotated[Tenant, Depends(explainer)]
) -> dict[str, Any]:
    """The routing decision for a chat or text completion body, without running it."""
    try:
        body = parse_generation_body(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    return _service(request).explain(body, request.headers, tenant)


@router.get("/v1/models")
async def models(request: Request, tenant: Reader) -> dict[str, Any]:
    return _service(request).models(tenant)


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str, tenant: Reader) -> dict[str, Any]:
    """One model or pinned branch, as in ``/v1/models``; 404 when unknown."""
    return _service(request).model(model_id, tenant)


@router.get("/metrics", dependencies=[Depends(require_operator)])
async def metrics(request: Request) -> Response:
    """Prometheus metrics of branches and devices (text exposition format)."""
    return Response(_service(request).metrics(), media_type=CONTENT_TYPE_LATEST)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The status page: plain HTML whose script reads the JSON endpoints below."""
    return HTMLResponse(DASHBOARD_HTML, headers=DASHBOARD_HEADERS)


@router.get("/dashboard/data", dependencies=[Depends(require_operator)])
async def dashboard_data(request: Request) -> dict[str, Any]:
    """What the router did in the last minute, and the last requests (for the page): those
    of every tenant for the admin key (or an open API) only, and their ids (which name
    streams) for the admin or the metrics key only."""
    data = _service(request).dashboard(everyone=sees_everyone(request))
    if not sees_request_ids(request):
        data["recent"] = [
            {k: v for k, v in entry.items() if k != "request_id"} for entry in data["recent"]
        ]
    return data


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
@router.get("/health")  # the readiness probe's name in vLLM, llama-server and most charts
async def readyz(request: Request) -> JSONResponse:
    """200 when every model has a branch that takes traffic; the body names failed ones
    (to whoever may read every model: otherwise it says ready or not, alone)."""
    ready, body = _service(request).readiness()
    if not sees_everything(request):
        body = {"status": body["status"]}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/version")
async def version(request: Request) -> dict[str, Any]:
    """quantroute's version and the llama.cpp revision its workers run."""
    return await _service(request).version()


@router.get("/v1/devices", dependencies=[Depends(require_operator)])
async def devices(request: Request) -> dict[str, Any]:
    return _service(request).devices()


class PressureBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    bytes: int = Field(ge=0, le=1 << 50)


@router.get("/admin/status", dependencies=[Depends(require_admin)])
async def admin_status(request: Request) -> dict[str, Any]:
    """Branch states, circuit breakers and the retry budget."""
    return _service(request).status()


@router.post("/admin/reload", dependencies=[Depends(require_admin)])
async def reload_repository(request: Request) -> dict[str, Any]:
    """Reload the model repository now; the body reports what swapped or failed."""
    return await _service(request).reload()


@router.put("/admin/devices/{device_id}/pressure", dependencies=[Depends(require_admin)])
async def set_pressure(request: Request, device_id: str) -> dict[str, Any]:
    """Simulated devices only: occupy ``bytes`` of a device, as another tenant would. The
    body is read as JSON whatever its content type (a PUT, and it needs the admin key)."""
    try:
        body = parse_body(await request.body(), PressureBody)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    _service(request).set_pressure(device_id, body.bytes)
    return {"device": device_id, "pressure_bytes": body.bytes}


@router.post("/admin/branches/{branch_id}/restart", dependencies=[Depends(require_admin)])
async def restart_branch(request: Request, branch_id: str) -> dict[str, Any]:
    """Restart a branch's engine (clears a failure): after fixing what failed it."""
    return await _service(request).restart(branch_id)


@router.post("/admin/branches/{branch_id}/drain", dependencies=[Depends(require_admin)])
async def drain_branch(request: Request, branch_id: str) -> dict[str, Any]:
    """No new requests for the branch, on every gateway of the fleet; those in flight
    finish (docs/cluster.md)."""
    return await _service(request).drain(branch_id)


@router.post("/admin/branches/{branch_id}/undrain", dependencies=[Depends(require_admin)])
async def undrain_branch(request: Request, branch_id: str) -> dict[str, Any]:
    """The drained branch takes requests again, on every gateway of the fleet."""
    return await _service(request).undrain(branch_id)

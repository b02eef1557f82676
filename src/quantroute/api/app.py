"""The FastAPI application factory and its lifespan.

The lifespan owns the :class:`Gateway` (every worker, the device poller and
background tasks) and the stream store (resumable streams): it starts the
gateway before the first request and, after the last, stops the streams'
producers, then the gateway; under ``quantroute serve`` it freezes the started
gateway's heap (:func:`freeze_startup_heap`). Outside every middleware,
:class:`HeadWithBody` sends a response's head and its first body in one TCP segment;
in front of the routes, :class:`~quantroute.api.gate.RequestGate` refuses a ``Host`` the
server does not answer to and a ``POST`` a foreign page could send unasked. The OpenAPI
schema and its page are served only with ``server.docs`` (no third-party script).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantroute.api.body_limit import BodyLimitMiddleware
from quantroute.api.direct import EXTENSION, DirectBody
from quantroute.api.errors import install_error_handlers
from quantroute.api.gate import HostRule, RequestGate
from quantroute.api.gateway import Gateway
from quantroute.api.reference import install_reference
from quantroute.api.routes import GenerationRoutes, router
from quantroute.config import Settings
from quantroute.resilience.resume import StreamStore
from quantroute.routing.table import RouteTable
from quantroute.shaping import pattern
from quantroute.telemetry import DeviceProvider

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    table: RouteTable | None = None,
    provider: DeviceProvider | None = None,
    *,
    freeze_gc: bool = False,
) -> FastAPI:
    """The app. ``table`` (with engines of any kind) replaces the repository scan and
    ``provider`` the configured device provider; both are started and stopped by the
    lifespan all the same. ``freeze_gc`` (``quantroute serve``: the process is this app's)
    moves what exists once the gateway has started out of the garbage collector's
    sight (:func:`freeze_startup_heap`)."""
    gateway = Gateway(settings, table, provider)
    copies = gateway.fleet.copies if gateway.fleet is not None else None  # to Redis
    streams = StreamStore(settings.streams, copies)  # streamed responses, kept for resuming

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(pattern.warm)  # once per process, off the event loop
        await gateway.start()
        grpc_server = None
        if settings.server.grpc_port:  # gRPC beside HTTP (grpcapi/); imported only when on
            from quantroute.grpcapi.server import start_grpc

            grpc_server = await start_grpc(gateway.service, gateway.tenants, settings)
        frozen = freeze_gc and freeze_startup_heap()
        try:
            yield
        finally:
            if frozen:
                gc.unfreeze()
            if grpc_server is not None:
                await grpc_server.stop()
            await streams.close()  # their producers hold runs on the gateway's engines
            await gateway.stop()

    # FastAPI's own OpenTelemetry stays off: the request's spans and metrics are ours
    # (observability/), and its check for a global provider costs every request.
    off = TelemetryConfig(tracing=False, metrics=False, logs=False)
    # FastAPI's /docs and /redoc load their scripts from a CDN: never; the schema and a
    # plain page of it (api/reference.py) only when asked for.
    app = _App(
        title="quantroute",
        version="0.1.0",
        lifespan=lifespan,
        telemetry=off,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.server.docs else None,
    )
    app.state.settings = settings
    app.state.gateway = gateway  # for tests and the lifespan; routes use the service only
    app.state.service = gateway.service
    app.state.tenants = gateway.tenants
    app.state.streams = streams
    app.include_router(router)
    if settings.server.docs:
        install_reference(app)
    # Middlewares run outermost last-added first: the Host and POST checks, the body
    # limit, the internal-error answer, then the generation endpoints (in front of the
    # router).
    app.add_middleware(GenerationRoutes)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.server.max_body_bytes)
    hosts = HostRule.of(settings.server.allowed_hosts, open_api=gateway.tenants.open)
    app.add_middleware(RequestGate, hosts=hosts)
    return app


def freeze_startup_heap() -> bool:
    """Collect once, then freeze every object left (``gc.freeze``), as vLLM's servers do
    after their start; whether it froze (not when something froze the heap already).

    What the gateway built to start (its modules, tables, engines, schemas: ~95,000
    objects with tiny-llama's repository) lives as long as the process, yet every full
    collection walked all of it: under load a full collection came every few seconds
    and stopped the event loop, every stream with it, for 46-102 ms here; frozen, 6-20 ms
    (docs/benchmarks.md, "A request's own cost, with the prompt cache on"). A frozen
    object is still freed when its last reference goes; only a cycle of them outlives
    its use (what a hot reload replaces of the first generation, once)."""
    if gc.get_freeze_count():
        return False
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "froze %d objects of the started gateway out of the collector's sight (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )
    return True


class _App(FastAPI):
    def build_middleware_stack(self) -> ASGIApp:
        return HeadWithBody(super().build_middleware_stack())  # it needs the server's send


class HeadWithBody:
    """Holds a response's head (``TCP_CORK``) until its first body is written, so both go
    out in one segment: a client is woken once, with its first chunk, not first by the
    head alone (which costs a stream's first token a context switch on a busy machine).

    It needs the server's own ``send`` (uvicorn's, whose object has the transport) and
    Linux; anywhere else it passes every message through as it is. Under uvicorn's
    httptools protocol it also offers the response a :class:`~quantroute.api.direct.DirectBody`
    (``scope["extensions"]``), open once the head and the first body are out."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sock = _socket(send) if scope["type"] == "http" else None
        if sock is None:
            await self.app(scope, receive, send)
            return
        corked = False
        direct = DirectBody.of(send)
        if direct is not None:
            extensions = {**(scope.get("extensions") or {}), EXTENSION: direct}
            scope = {**scope, "extensions": extensions}

        async def coalescing(message: Message) -> None:
            nonlocal corked
            if message["type"] == "http.response.start":
                corked = _cork(sock, True)
                await send(message)
                return
            try:
                await send(message)
            finally:
                if corked:
                    corked = not _cork(sock, False)
            if direct is not None and not corked:  # the head is out, and a body with it
                direct.open()

        try:
            await self.app(scope, receive, coalescing)
        finally:
            if direct is not None:
                direct.close()  # the connection's next response is another's
            if corked:
                _cork(sock, False)


_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)


def _socket(send: Send) -> Any:
    if _TCP_CORK is None:
        return None
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    get_extra_info = getattr(transport, "get_extra_info", None)
    return None if get_extra_info is None else get_extra_info("socket")


def _cork(sock: Any, on: bool) -> bool:
    """Set ``TCP_CORK``; whether it was set (a closed socket is left alone)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1 if on else 0)
    except (OSError, ValueError, AttributeError):
        return False
    return True

"""The FastAPI application factory and its lifespan.

The lifespan owns every worker and background task: it scans the model
repository, starts a worker per branch (all at once), publishes the route
table, and on shutdown stops everything in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from quantroute.api.body_limit import BodyLimitMiddleware
from quantroute.api.errors import install_error_handlers
from quantroute.api.routes import router
from quantroute.api.service import CompletionService
from quantroute.config import Settings
from quantroute.engines.base import Engine
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.registry.repository import scan_repository
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef

log = logging.getLogger(__name__)


def build_routes(settings: Settings) -> RouteTable:
    """One engine per branch of every model the repository holds (none started yet)."""
    scan = scan_repository(settings.repo)
    e = settings.engine
    options = WorkerOptions(
        n_ctx=e.n_ctx,
        parallel=e.parallel,
        n_threads=e.n_threads,
        n_batch=e.n_batch,
        log_level=settings.server.log_level,
        start_timeout_s=e.start_timeout_s,
    )
    policy = RestartPolicy(
        backoff_s=e.restart_backoff_s,
        backoff_max_s=e.restart_backoff_max_s,
        stop_grace_s=e.cancel_grace_s,
    )
    routes = []
    for model in scan.models:
        branches = tuple(
            Branch(
                model=a.model,
                name=a.name,
                precision=a.precision,
                artifact=a,
                engine=LlamaCppEngine(f"{a.model}:{a.name}", a.path, options, policy),
            )
            for a in model.artifacts
        )
        routes.append(ModelRoute(model.manifest.model, model.manifest.reference, branches))
    return RouteTable.build(routes)


def create_app(settings: Settings, table: RouteTable | None = None) -> FastAPI:
    """The app. ``table`` (with engines of any kind) replaces the repository scan;
    its engines are started and stopped by the lifespan all the same."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        routes = table if table is not None else await asyncio.to_thread(build_routes, settings)
        engines: list[Engine] = [b.engine for b in routes.branches()]
        app.state.routes = RouteTableRef(routes)
        app.state.service = CompletionService(app.state.routes, settings)
        await asyncio.gather(*(engine.start() for engine in engines))
        log.info("serving %s", ", ".join(b.id for b in routes.branches() if b.engine.ready))
        try:
            yield
        finally:
            for engine in reversed(engines):
                await engine.stop()

    app = FastAPI(title="quantroute", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.server.max_body_bytes)
    return app

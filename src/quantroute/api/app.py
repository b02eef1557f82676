"""The FastAPI application factory and its lifespan.

The lifespan owns the :class:`Gateway` (every worker, the device poller and
background tasks) and the stream store (resumable streams): it starts the
gateway before the first request and, after the last, stops the streams'
producers, then the gateway.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from quantroute.api.body_limit import BodyLimitMiddleware
from quantroute.api.errors import install_error_handlers
from quantroute.api.gateway import Gateway
from quantroute.api.routes import GenerationRoutes, router
from quantroute.config import Settings
from quantroute.resilience.resume import StreamStore
from quantroute.routing.table import RouteTable
from quantroute.telemetry import DeviceProvider


def create_app(
    settings: Settings, table: RouteTable | None = None, provider: DeviceProvider | None = None
) -> FastAPI:
    """The app. ``table`` (with engines of any kind) replaces the repository scan and
    ``provider`` the configured device provider; both are started and stopped by the
    lifespan all the same."""
    gateway = Gateway(settings, table, provider)
    streams = StreamStore(settings.streams)  # streamed responses, kept for resuming

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await streams.close()  # their producers hold runs on the gateway's engines
            await gateway.stop()

    app = FastAPI(title="quantroute", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.gateway = gateway  # for tests and the lifespan; routes use the service only
    app.state.service = gateway.service
    app.state.tenants = gateway.tenants
    app.state.streams = streams
    app.include_router(router)
    # Middlewares run outermost last-added first: the body limit, the internal-error
    # answer, then the generation endpoints (in front of the router).
    app.add_middleware(GenerationRoutes)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.server.max_body_bytes)
    return app

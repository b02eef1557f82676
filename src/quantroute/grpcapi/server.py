"""The gRPC server beside the HTTP one: ``quantroute.v1.Quantroute``, the standard
``grpc.health.v1.Health`` service and server reflection, on ``server.host`` and
``server.grpc_port``, in the app's event loop.

The app's lifespan starts it after the gateway and stops it before the gateway::

    grpc_server = await start_grpc(gateway.service, gateway.tenants, settings)
    try:
        yield
    finally:
        if grpc_server is not None:
            await grpc_server.stop()

Calls are bounded as HTTP requests are: a message by ``server.max_body_bytes``, its
metadata by ``server.max_header_bytes``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from quantroute.api.service import Service
from quantroute.config import Settings
from quantroute.errors import ConfigError
from quantroute.grpcapi.keys import Keys
from quantroute.grpcapi.proto import SERVICE_NAME, pb_grpc
from quantroute.grpcapi.servicer import Servicer
from quantroute.resilience.tenants import Tenants
from quantroute.tasks import cancel_and_wait

__all__ = ["HEALTH_POLL_S", "GrpcServer", "start_grpc"]

log = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # how often the health service reads the gateway's readiness
STOP_GRACE_S = 5.0  # what calls in flight get to finish when the server stops
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    """A started gRPC server and the task that keeps its health service current: SERVING
    while the gateway is ready (``Service.readiness``: every model has a branch that takes
    traffic), NOT_SERVING otherwise, for the whole server (``""``) and for
    ``quantroute.v1.Quantroute``."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health: health.aio.HealthServicer,
        ready: Callable[[], bool],
    ):
        self.port = port  # the bound port
        self._server = server
        self._health = health
        self._ready = ready
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._check()  # before the first call: never the servicer's default SERVING
        await self._server.start()
        self._watch = asyncio.create_task(self._keep_checking(), name="grpc-health")

    async def _check(self) -> None:
        status = _SERVING if self._ready() else _NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _keep_checking(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self._check()
            except Exception:  # a view that failed: say so, and keep the loop alive
                log.exception("gRPC health: readiness could not be read")
                await self._health.set("", _NOT_SERVING)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """NOT_SERVING from now on; new calls refused, those in flight given ``grace_s``
        to finish, then cancelled (which cancels their generations)."""
        await cancel_and_wait(self._watch)
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)


async def start_grpc(
    service: Service, tenants: Tenants, settings: Settings, *, port: int | None = None
) -> GrpcServer | None:
    """Start the gRPC server on ``settings.server.host`` and ``settings.server.grpc_port``
    (``port`` overrides it: a test's free port); ``None`` when the port is 0 (off).

    ``service`` answers every call, ``tenants`` and ``settings`` check its key as HTTP's
    do (``api/auth.py``). A port that cannot be bound is a :class:`ConfigError`."""
    server_settings = settings.server
    port = server_settings.grpc_port if port is None else port
    if port == 0:
        return None
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", server_settings.max_body_bytes),
            ("grpc.max_metadata_size", server_settings.max_header_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
        ]
    )
    pb_grpc.add_QuantrouteServicer_to_server(Servicer(service, Keys(tenants, settings)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    host = server_settings.host
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address}: {exc}") from exc
    grpc_server = GrpcServer(server, bound, health_servicer, lambda: service.readiness()[0])
    await grpc_server.start()
    log.info("gRPC API on %s (quantroute.v1.Quantroute, health, reflection)", address)
    return grpc_server

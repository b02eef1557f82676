"""The HTTP API as an application any ASGI server can load, built from the settings as
``quantroute serve`` builds it (flags aside: the environment's ``QUANTROUTE_*`` variables
and ``QUANTROUTE_CONFIG``'s file). ``quantroute serve`` runs it under uvicorn, HTTP/1.1;
an ASGI server that speaks HTTP/2 serves it over h2c and over TLS with ALPN
(docs/api.md, "HTTP/2")::

    hypercorn --bind 127.0.0.1:8443 --certfile cert.pem --keyfile key.pem 'quantroute.asgi:app()'

The server's own flags then say where it listens (``server.host`` and ``server.port`` are
``quantroute serve``'s); the lifespan is the app's, under any server: the gateway, its
workers and, with ``server.grpc_port``, the gRPC API start and stop with it."""

from __future__ import annotations

from fastapi import FastAPI

from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.observability import configure_logging

__all__ = ["app"]


def app() -> FastAPI:
    """A new app from the settings (a factory: ``uvicorn --factory quantroute.asgi:app``,
    ``hypercorn 'quantroute.asgi:app()'``, ``granian --factory``)."""
    settings = load_settings()
    configure_logging(settings.server.log_level, settings.observability.log_format)
    return create_app(settings, freeze_gc=True)  # the process is the app's, as under serve

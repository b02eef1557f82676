"""The HTTP API: an OpenAI-compatible FastAPI application."""

from __future__ import annotations

from quantroute.api.app import create_app
from quantroute.api.gateway import Gateway

__all__ = ["Gateway", "create_app"]

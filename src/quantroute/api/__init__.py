"""The HTTP API: an OpenAI-compatible FastAPI application."""

from __future__ import annotations

from quantroute.api.app import build_routes, create_app

__all__ = ["build_routes", "create_app"]

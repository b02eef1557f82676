"""quantroute: an LLM inference server that picks the precision branch per request."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]

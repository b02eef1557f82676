"""Telemetry settings: ``Settings.telemetry`` of the settings tree in ``config.py``."""

from __future__ import annotations

from quantroute.config import TelemetrySettings

__all__ = ["TelemetrySettings"]

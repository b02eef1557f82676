"""The status page (``GET /dashboard``): one HTML file with its script inline, no build step.

The script polls quantroute's own JSON endpoints (``/v1/models``, ``/v1/devices``,
``/dashboard/data``) every two seconds and draws, with plain DOM and SVG:
each model's branches (state, profile, load), each device's memory over time,
the quality/speed/memory plot of each model, and what the router did in the
last minute (decisions by branch and reason, fallbacks, the last requests).
"""

from __future__ import annotations

from importlib.resources import files

DASHBOARD_HTML = (files("quantroute.observability") / "static" / "dashboard.html").read_text()

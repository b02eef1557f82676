"""The status page (``GET /dashboard``): one HTML file with its script inline, no build step.

The script polls quantroute's own JSON endpoints (``/v1/models``, ``/v1/devices``,
``/dashboard/data``) every two seconds and draws, with plain DOM and SVG:
each model's branches (state, profile, load), each device's memory over time,
the quality/speed/memory plot of each model, and what the router did in the
last minute (decisions by branch and reason, fallbacks, the last requests).
"""

from __future__ import annotations

import base64
import hashlib
from importlib.resources import files

DASHBOARD_HTML = (files("quantroute.observability") / "static" / "dashboard.html").read_text()


def _script_hash(html: str) -> str:
    """The CSP source of the page's one inline script: ``'sha256-<base64>'``."""
    script = html.split("<script>", 1)[1].split("</script>", 1)[0]
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


# The page runs its own script alone, talks to this server alone, and is framed by
# nobody: a policy that leaves an injected script or a clickjacking frame nothing to do.
DASHBOARD_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": (
        f"default-src 'none'; script-src {_script_hash(DASHBOARD_HTML)}; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

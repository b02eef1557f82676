"""``GET /docs`` (with ``server.docs`` on): the API's reference as one plain HTML page built
from the OpenAPI schema, with no script at all.

FastAPI's own ``/docs`` and ``/redoc`` load Swagger UI and ReDoc from a CDN, on the
origin where the status page keeps its key: a script the server never saw would run
there. This page is text and a link to ``/openapi.json`` (the schema itself, which a
tool of the reader's choosing can render), under a policy that runs no script.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

__all__ = ["REFERENCE_HEADERS", "install_reference", "reference_html"]

# No script, no fetch, no frame: text and styles alone.
REFERENCE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
_METHODS = ("get", "post", "put", "patch", "delete")
# The two generation endpoints are an ASGI layer in front of the router (api/routes.py),
# so the schema does not list them: the page does.
_GENERATION = (
    ("post", "/v1/chat/completions", "A chat completion (OpenAI's API; docs/api.md)."),
    ("post", "/v1/completions", "A text completion (OpenAI's API; docs/api.md)."),
)


def reference_html(schema: dict[str, Any]) -> str:
    """The page: each endpoint's method, path and summary, every text escaped."""
    rows = [(m, p, s) for m, p, s in _GENERATION]
    for path, operations in sorted(schema.get("paths", {}).items()):
        for method in _METHODS:
            op = operations.get(method)
            if op is not None:
                doc = op.get("summary") or (op.get("description") or "").split("\n\n")[0]
                rows.append((method, path, " ".join(doc.split())))
    info = schema.get("info", {})
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    body = "\n".join(
        f"<tr><td>{html.escape(m.upper())}</td><td><code>{html.escape(p)}</code></td>"
        f"<td>{html.escape(s)}</td></tr>"
        for m, p, s in rows
    )
    return (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        f"<title>{title}</title>"
        "<style>body{font:14px system-ui,sans-serif;margin:2em}td{padding:2px 12px;"
        "vertical-align:top}code{white-space:nowrap}</style>"
        f"<h1>{title}</h1><p>The schema: <a href=/openapi.json>/openapi.json</a>. "
        "Request fields, errors and extensions: docs/api.md.</p>"
        f"<table><thead><tr><th>method<th>path<th>what</thead><tbody>{body}</tbody></table>"
    )


def install_reference(app: FastAPI) -> None:
    """Serve :func:`reference_html` of ``app``'s schema at ``/docs`` (built once, on the
    first request)."""
    page: list[str] = []

    async def docs() -> HTMLResponse:
        if not page:
            page.append(reference_html(app.openapi()))
        return HTMLResponse(page[0], headers=REFERENCE_HEADERS)

    app.add_api_route(
        "/docs", docs, methods=["GET"], include_in_schema=False, response_class=HTMLResponse
    )

"""``/docs``, ``/redoc`` and ``/openapi.json`` are off unless ``server.docs`` is on, and then
served without a third-party script. Before (issue 32, L-findings) all three were open,
and the two pages loaded Swagger UI and ReDoc from a CDN on the origin where the status
page keeps its key. The status page's own policy stays as strict."""

from __future__ import annotations

import re

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings


def _app(docs: bool) -> object:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server={"docs": docs})
    return create_app(settings, fake_table())


async def test_the_schema_and_its_pages_are_off_by_default() -> None:
    async with serving(_app(False)) as (client, _):
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = await client.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"


async def test_with_docs_on_the_page_has_no_script_and_the_schema_is_served() -> None:
    async with serving(_app(True)) as (client, _):
        schema = await client.get("/openapi.json")
        assert schema.status_code == 200 and "/v1/models" in schema.json()["paths"]
        page = await client.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        text = page.text.lower()
        assert "<script" not in text and "cdn" not in text and "swagger" not in text
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text)  # nothing foreign
        assert "/v1/chat/completions" in page.text and "/v1/streams/{stream_id}" in page.text
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy
        assert "frame-ancestors 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert (await client.get("/redoc")).status_code == 404  # never: it needs a CDN
        # the status page keeps its own strict policy
        dashboard = await client.get("/dashboard")
        policy = dashboard.headers["content-security-policy"]
        assert "script-src 'sha256-" in policy and "unsafe" not in policy.split("style-src")[0]
        assert "http" not in policy

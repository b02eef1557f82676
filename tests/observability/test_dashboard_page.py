"""``GET /dashboard``'s headers: the page may run its own inline script and nothing else,
talk only to this server, and never be framed (the browser test runs it under them)."""

from __future__ import annotations

import base64
import hashlib

from qrtest import fake_app, serving


async def test_the_status_page_allows_its_own_script_alone() -> None:
    async with serving(fake_app()) as (client, _):
        r = await client.get("/dashboard")
    assert r.status_code == 200
    policy = dict(
        part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";")
    )
    script = r.text.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert policy["script-src"] == f"'sha256-{digest}'"  # no 'unsafe-inline', no hosts
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'" and r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"

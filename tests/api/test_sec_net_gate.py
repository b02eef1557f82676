"""The request gate (``api/gate.py``), against the real app under uvicorn on a loopback
socket and in-process: an open API answers only loopback ``Host`` names (DNS rebinding),
configured names exactly, any with client keys; a ``POST`` needs a JSON content type or
an ``Authorization`` header (a foreign page's "simple request" is refused). Before
(issue 32, M4) ``Host: evil.example`` and a ``text/plain`` POST were both served."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from qrtest import ADMIN, fake_app, fake_table, live, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.errors import ConfigError

BODY = {"model": "tiny-llama:q8_0", "prompt": "def ", "max_tokens": 4}
CHAT = {"model": "tiny-llama:q8_0", "messages": [{"role": "user", "content": "hi"}]}


def _app(**server: Any) -> Any:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server=server)
    return create_app(settings, fake_table())


async def _raw(port: int, head: bytes) -> tuple[int, bytes]:
    """Send ``head`` (a request without a body) as it is; the status and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)  # the request says close
    finally:
        writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, raw.partition(b"\r\n\r\n")[2]


def _get(*hosts: bytes, path: bytes = b"/healthz") -> bytes:
    lines = [b"GET " + path + b" HTTP/1.1", *[b"host: " + h for h in hosts], b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _refused_host(status: int, body: bytes, host: bytes) -> None:
    assert status == 400, body
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "host_not_allowed",
        "Host",
    )
    assert not host or host.split(b":")[0] not in body  # never echoed


async def test_an_open_api_answers_loopback_host_names_only() -> None:
    async with live(fake_app()) as port:
        p = str(port).encode()
        for host in (b"localhost:" + p, b"localhost", b"127.0.0.1:" + p, b"[::1]:" + p,
                     b"LocalHost:" + p, b"localhost.:" + p, b"127.0.0.1"):  # fmt: skip
            status, body = await _raw(port, _get(host))
            assert status == 200, (host, body)
        for host in (b"evil.example", b"evil.example:" + p, b"localhost.evil.example",
                     b"127.0.0.1.nip.io:" + p, b"localhost:80x", b"[::1", b"[::1]x",
                     b"attacker-localhost", b"0.0.0.0:" + p):  # fmt: skip
            status, body = await _raw(port, _get(host))
            _refused_host(status, body, host)
        # every route, POSTs and the status page's data included
        status, body = await _raw(port, _get(b"evil.example", path=b"/dashboard/data"))
        _refused_host(status, body, b"evil.example")
        # no Host at all (HTTP/1.0), and two that differ: neither passes
        status, body = await _raw(port, b"GET /healthz HTTP/1.0\r\n\r\n")
        _refused_host(status, body, b"")
        status, body = await _raw(port, _get(b"localhost:" + p, b"evil.example"))
        _refused_host(status, body, b"evil.example")
        assert (await _raw(port, _get(b"localhost", b"localhost")))[0] == 200


async def test_with_client_keys_any_host_is_answered(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text('tenants: {acme: {keys: ["sk-acme"]}}')
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"}, auth={"tenants_file": str(tenants)}
    )
    async with live(create_app(settings, fake_table())) as port:
        assert (await _raw(port, _get(b"evil.example")))[0] == 200
        assert (await _raw(port, _get(b"evil.example", path=b"/v1/models")))[0] == 401


@pytest.mark.parametrize(
    ("allowed", "host", "status"),
    [
        (["api.example.com", "*.corp.example"], "api.example.com:8443", 200),
        (["api.example.com", "*.corp.example"], "a.b.corp.example", 200),
        (["api.example.com", "*.corp.example"], "corp.example", 400),  # subdomains only
        (["api.example.com", "*.corp.example"], "xcorp.example", 400),
        (["api.example.com", "*.corp.example"], "localhost", 400),  # exactly those
        (["api.example.com", "*.corp.example"], "evil.example", 400),
        (["*"], "evil.example", 200),
        (["localhost", "[::1]"], "[::1]:9", 200),
        (["localhost"], "127.0.0.1", 400),
    ],
)
async def test_configured_hosts_are_exactly_those(
    allowed: list[str], host: str, status: int
) -> None:
    async with serving(_app(allowed_hosts=allowed)) as (client, _):
        r = await client.get("/healthz", headers={"host": host})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["code"] == "host_not_allowed" and host not in r.text


@pytest.mark.parametrize("allowed", [["localhost:http"], [""], ["[::1"], []])
def test_a_bad_allowed_host_is_a_config_error(allowed: list[str]) -> None:
    with pytest.raises(ConfigError):
        _app(allowed_hosts=allowed)


def _refused_post(r: httpx.Response) -> None:
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "unsupported_media_type",
        "Content-Type",
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/route/explain"])
async def test_a_post_needs_a_json_content_type_or_an_authorization_header(path: str) -> None:
    body = json.dumps(CHAT if "chat" in path else BODY).encode()
    async with serving(fake_app()) as (client, _):
        # what a page on another origin may send without a preflight: refused
        for content_type in ("text/plain", "text/plain; charset=utf-8",
                             "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                             None, "application/jsonx", "application/json-seq"):  # fmt: skip
            headers = {} if content_type is None else {"content-type": content_type}
            _refused_post(await client.post(path, content=body, headers=headers))
        # JSON (any parameters, any case), or any Authorization (a page cannot send one
        # without a preflight): served as before
        for headers in (
            {"content-type": "application/json"},
            {"content-type": "Application/JSON ; charset=utf-8"},
            {"content-type": "text/plain", "authorization": "Bearer anything"},
            {"authorization": "Bearer anything"},
        ):
            r = await client.post(path, content=body, headers=headers)
            assert r.status_code == 200, (headers, r.text)


async def test_admin_posts_too_and_other_methods_are_left_as_they_were() -> None:
    async with serving(fake_app()) as (client, _):
        _refused_post(await client.post("/admin/reload", content=b"{}"))
        r = await client.post("/admin/reload", headers=ADMIN)  # no body, but the key
        assert r.status_code != 415
        r = await client.post("/admin/branches/tiny-llama:q8_0/restart")
        _refused_post(r)
        # PUT always needs a preflight: its body is read as JSON whatever its type
        r = await client.put(
            "/admin/devices/sim:0/pressure",
            content=b'{"bytes": 0}',
            headers=ADMIN | {"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 200
        assert (await client.get("/healthz", headers={"content-type": "text/plain"})).is_success


async def test_the_official_openai_client_passes_the_gate() -> None:
    async with live(fake_app()) as port:
        base = f"http://127.0.0.1:{port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as c:
            done = await c.completions.create(model="tiny-llama:q8_0", prompt="a", max_tokens=3)
            assert done.choices[0].text
            chunks = await c.chat.completions.create(
                model="tiny-llama:q8_0", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert [chunk async for chunk in chunks]
        async with httpx.AsyncClient(base_url=f"http://localhost:{port}") as http:
            # the status page's own requests: GETs, same origin, the key as a header
            for path in ("/dashboard", "/v1/models", "/v1/devices", "/dashboard/data"):
                assert (await http.get(path, headers=ADMIN)).status_code == 200, path

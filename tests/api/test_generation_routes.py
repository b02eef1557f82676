"""The generation endpoints are one ASGI layer in front of FastAPI's router
(``routes.GenerationRoutes``): the same answers as a route, over real sockets: the
key before the body, the body as JSON whatever its declared type (with an
``Authorization`` header; without one a POST must say JSON: ``api/gate.py``), the
schema's errors, the body limit, a 405 naming the method, and an unexpected error as a
500 body."""

from __future__ import annotations

from pathlib import Path

import pytest

from qrtest import fake_app, fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

KEY = "sk-acme-generation"
BODY = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}'
PATHS = ("/v1/completions", "/v1/chat/completions")
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("content_type", [None, "application/json", "text/plain"])
async def test_a_body_is_json_whatever_type_it_says(content_type: str | None) -> None:
    headers = {"authorization": "Bearer any"}  # no key: a POST must say JSON (test_sec_net_gate)
    if content_type is not None:
        headers["content-type"] = content_type
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/completions", content=BODY, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "The request body is missing."),
        (b"[1]", "The request body must be a JSON object."),
        (b'"text"', "The request body must be a JSON object."),
        (b"{bad", "The request body is not valid JSON."),
        (b"\xff\xfe", "The request body is not valid JSON."),
    ],
)
async def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(
    path: str, raw: bytes, message: str
) -> None:
    async with serving(fake_app()) as (http, _):
        r = await http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }


@pytest.mark.parametrize("path", PATHS)
async def test_a_schema_error_names_its_field(path: str) -> None:
    async with serving(fake_app()) as (http, _):
        r = await http.post(path, json={"model": "tiny-llama", "prompt": "x", "n": 0})
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error"
        assert error["param"] in ("n", "messages")  # chat: no messages


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_another_method_is_a_405_that_names_post(method: str) -> None:
    async with serving(fake_app()) as (http, _):
        for path in PATHS:
            r = await http.request(method, path)
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            assert r.json()["error"]["type"] == "invalid_request_error"


async def test_the_key_is_checked_before_the_body_is_read(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  acme:\n    keys: [{KEY!r}]\n")
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"}, auth={"tenants_file": str(tenants)}
    )
    async with serving(create_app(settings, fake_table())) as (http, _):
        for raw in (b"{bad", BODY):
            r = await http.post("/v1/completions", content=raw, headers=JSON)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        auth = {"authorization": f"Bearer {KEY}"}
        r = await http.post("/v1/completions", content=b"{bad", headers=auth)
        assert r.status_code == 400
        r = await http.post("/v1/completions", content=BODY, headers=auth)
        assert r.status_code == 200


async def test_the_body_limit_and_the_internal_error_answer_apply_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server={"max_body_bytes": 1024})
    async with serving(create_app(settings, fake_table())) as (http, _):
        big = b'{"prompt": "' + b"x" * 2000 + b'"}'
        r = await http.post("/v1/completions", content=big, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    from quantroute.api import routes

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes, "_respond", broken)
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/completions", content=BODY, headers=JSON)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "a bug" not in r.text
        assert (await http.get("/healthz")).status_code == 200  # the server still answers

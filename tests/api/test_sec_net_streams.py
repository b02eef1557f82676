"""Nobody reads another client's stream (issue 32, M4). Before, an open API (the default)
listed every request id on ``/dashboard/data`` to anyone, and ``GET /v1/streams/{id}``
replayed that request's whole output for 300 s. Now ids are for the admin and metrics
keys only, and a stream is resumed by its tenant, and, with an open API, only with the
secret its first response carried (``x-quantroute-stream-token``): without it the answer
is the 404 of a stream that does not exist. Real uvicorn on a loopback socket."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from qrtest import ADMIN, ADMIN_KEY, fake_table, live
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

BODY = {"model": "tiny-llama:q8_0", "prompt": "def ", "max_tokens": 16, "stream": True}
TOKEN = "x-quantroute-stream-token"
METRICS = {"authorization": "Bearer sk-scraper"}


def _app(tmp_path: Path | None = None) -> object:
    auth = {}
    if tmp_path is not None:
        tenants = tmp_path / "tenants.yaml"
        tenants.write_text('tenants: {acme: {keys: ["sk-acme"]}, other: {keys: ["sk-other"]}}')
        auth = {"tenants_file": str(tenants)}
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY, "metrics_key": "sk-scraper"},
        auth=auth,
    )
    return create_app(settings, fake_table({"q8_0": FakeEngine()}))


def _data(r: httpx.Response) -> list[str]:
    return [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]


async def test_an_open_api_resumes_a_stream_only_with_its_token() -> None:
    async with (
        live(_app()) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        r = await http.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and _data(r)[-1] == "[DONE]"
        job, token = r.headers["x-request-id"], r.headers[TOKEN]
        assert len(token) >= 32 and token not in r.text and job not in token
        unknown = await http.get(f"/v1/streams/{'0' * 32}", headers={TOKEN: token})
        assert unknown.status_code == 404
        for headers in ({}, {TOKEN: ""}, {TOKEN: "0" * 32}, {TOKEN: token[:-1]}, ADMIN):
            r = await http.get(f"/v1/streams/{job}", headers=headers)
            # not even whether it exists: the unknown stream's answer, word for word
            assert (r.status_code, r.json()) == (404, unknown.json()), headers
            assert r.json()["error"]["code"] == "stream_not_found"
        r = await http.get(f"/v1/streams/{job}", headers={TOKEN: token})
        assert r.status_code == 200 and _data(r)[-1] == "[DONE]"
        assert TOKEN not in r.headers  # a resume is not handed the secret again
        r = await http.get(
            f"/v1/streams/chatcmpl-{job}", headers={TOKEN: token}, params={"starting_after": 2}
        )
        assert r.status_code == 200 and len(_data(r)) >= 1


async def test_with_tenants_only_the_owner_resumes_and_a_wrong_token_fails(
    tmp_path: Path,
) -> None:
    acme = {"authorization": "Bearer sk-acme"}
    other = {"authorization": "Bearer sk-other"}
    async with (
        live(_app(tmp_path)) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        r = await http.post("/v1/completions", json=BODY, headers=acme)
        job, token = r.headers["x-request-id"], r.headers[TOKEN]
        r = await http.get(f"/v1/streams/{job}", headers=other | {TOKEN: token})
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        r = await http.get(f"/v1/streams/{job}", headers=acme | {TOKEN: "f" * 32})
        assert r.status_code == 404
        for headers in (acme, acme | {TOKEN: token}):  # the key is the check; the token extra
            r = await http.get(f"/v1/streams/{job}", headers=headers)
            assert r.status_code == 200 and _data(r)[-1] == "[DONE]"


async def test_request_ids_are_shown_to_the_admin_and_metrics_keys_only() -> None:
    async with (
        live(_app()) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        r = await http.post("/v1/completions", json=BODY)
        job = r.headers["x-request-id"]
        r = await http.post("/v1/completions", json=BODY | {"stream": False})
        jobs = {job, r.headers["x-request-id"]}
        anonymous = await http.get("/dashboard/data")
        assert anonymous.status_code == 200
        data = anonymous.json()
        assert data["requests"] == 2 and len(data["recent"]) == 2  # what happened, still
        assert all("request_id" not in entry for entry in data["recent"])
        assert not any(j in anonymous.text or j[:12] in anonymous.text for j in jobs)
        for key in (ADMIN, METRICS):
            seen = (await http.get("/dashboard/data", headers=key)).json()
            assert {entry["request_id"] for entry in seen["recent"]} == jobs
        # a client key of nobody's is anonymous as well (an open API ignores keys)
        wrong = (await http.get("/dashboard/data", headers={"authorization": "Bearer x"})).json()
        assert all("request_id" not in entry for entry in wrong["recent"])
        assert "request_id" not in json.dumps(wrong)

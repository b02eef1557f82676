"""Resumable streams against a real ``quantroute serve``: drop a stream, reconnect with
``Last-Event-ID``, and get exactly the rest; other tenants and expired streams 404."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from qrtest import demo_model_dir, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RETENTION_S = 4.0
TENANTS = """
tenants:
  acme:
    keys: ["sk-acme"]
  other:
    keys: ["sk-other"]
"""
ACME = {"authorization": "Bearer sk-acme"}
OTHER = {"authorization": "Bearer sk-other"}
BODY = {
    "model": "tiny-llama:q8_0",
    "prompt": "def main():\n",
    "max_tokens": 200,
    "temperature": 0.0,
    "seed": 7,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tenants = tmp_path_factory.mktemp("resume") / "tenants.yaml"
    tenants.write_text(TENANTS)
    flags = ("--engine-parallel", "2", "--auth-tenants-file", str(tenants),
             "--streams-retention-s", str(RETENTION_S))  # fmt: skip
    with serve_process(demo_model_dir().parent, *flags, ready_s=90) as url:
        yield url


class Event:
    def __init__(self, fields: dict[str, str]):
        self.id = fields.get("id")
        self.retry = fields.get("retry")
        self.data = fields["data"]

    @property
    def seq(self) -> int:
        assert self.id is not None
        return int(self.id.rpartition("/")[2])

    @property
    def text(self) -> str:
        if self.data == "[DONE]":
            return ""
        return "".join(c["text"] for c in json.loads(self.data).get("choices", []))


def _events(lines: Iterator[str], limit: int | None = None) -> list[Event]:
    """SSE events (those with data) off a line iterator; keep-alive comments skipped."""
    out: list[Event] = []
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                out.append(Event(fields))
                if limit is not None and len(out) == limit:
                    break
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
    return out


def _stream(
    http: httpx.Client, method: str, url: str, limit: int | None = None, **kw: Any
) -> tuple[httpx.Response, list[Event]]:
    with http.stream(method, url, **kw) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        return r, _events(r.iter_lines(), limit)  # leaving early hangs up


def _check_ids(events: list[Event], job: str, first: int) -> None:
    assert [e.id for e in events] == [f"{job}/{first + i}" for i in range(len(events))]


def test_a_dropped_stream_resumes_with_last_event_id_exactly(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30, headers=ACME) as http:
        r, whole = _stream(http, "POST", "/v1/completions", json=BODY)
        assert r.status_code == 200 and whole[-1].data == "[DONE]"
        job = r.headers["x-request-id"]
        _check_ids(whole, job, 0)  # every event has an id
        assert whole[0].retry == "1000" and all(e.retry is None for e in whole[1:])
        expected = "".join(e.text for e in whole)
        assert len(expected) > 100

        resumable = {"x-quantroute-resumable": "true"}
        r, before = _stream(http, "POST", "/v1/completions", limit=5, json=BODY, headers=resumable)
        job = r.headers["x-request-id"]
        _check_ids(before, job, 0)
        r, after = _stream(
            http, "GET", f"/v1/streams/{job}", headers={"last-event-id": before[-1].id or ""}
        )
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
        _check_ids(after, job, 5)  # exactly the events after the last one seen
        assert after[0].retry == "1000"
        assert after[-1].data == "[DONE]"
        assert "".join(e.text for e in before + after) == expected  # nothing lost or doubled

        # the finished stream again, by the query parameter and by a chunk's own id
        r, tail = _stream(http, "GET", f"/v1/streams/cmpl-{job}", params={"starting_after": 2})
        assert [e.data for e in tail] == [e.data for e in (before + after)[3:]]


def test_a_stream_that_was_not_resumable_is_cancelled_when_dropped(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30, headers=ACME) as http:
        body = BODY | {"max_tokens": 400, "prompt": "x"}
        with http.stream("POST", "/v1/completions", json=body) as r:
            job = r.headers["x-request-id"]
            before = _events(r.iter_lines(), 3)
        time.sleep(0.5)
        r, after = _stream(
            http, "GET", f"/v1/streams/{job}", headers={"last-event-id": before[-1].id or ""}
        )
        assert r.status_code == 200
        # what it made before the hang-up, then why it ended: it did not run to its end
        assert json.loads(after[-1].data)["error"]["code"] == "stream_cancelled"
        assert "[DONE]" not in [e.data for e in after]
        _check_ids(before + after, job, 0)


def test_resumes_of_other_tenants_unknown_streams_or_unseen_events_are_refused(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30) as http:
        body = BODY | {"max_tokens": 8}
        r, events = _stream(http, "POST", "/v1/completions", json=body, headers=ACME)
        job = r.headers["x-request-id"]
        assert events[-1].data == "[DONE]"
        for key, headers in ((job, OTHER), ("0" * 32, ACME)):
            r = http.get(f"/v1/streams/{key}", headers=headers)
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "stream_not_found"
        assert http.get(f"/v1/streams/{job}").status_code == 401  # no key at all
        r = http.get(f"/v1/streams/{job}", headers=ACME | {"last-event-id": "someone-else/3"})
        assert r.status_code == 400
        # ids no client was given, each a 400 naming where it came from: digits int()
        # refuses ("²" passes str.isdigit), too many digits, too long, below zero
        for params, raw, param in (
            ({}, "\xb2".encode("latin-1"), "Last-Event-ID"),
            ({}, f"{job}/1\xb9".encode("latin-1"), "Last-Event-ID"),
            ({}, b"9" * 19, "Last-Event-ID"),
            ({}, b"x" * 300, "Last-Event-ID"),
            ({"starting_after": "\u00b2"}, None, "starting_after"),
            ({"starting_after": "-1"}, None, "starting_after"),
            ({"starting_after": "1e3"}, None, "starting_after"),
        ):
            extra = {} if raw is None else {"last-event-id": raw}
            r = http.get(f"/v1/streams/{job}", params=params, headers=ACME | extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # past its last event: no client saw that id, and an empty 200 would read as a cut
        # stream (an EventSource would reconnect with it for ever)
        last = events[-1].seq
        for params, headers, param in (
            ({}, {"last-event-id": f"{job}/{last + 1}"}, "Last-Event-ID"),
            ({"starting_after": last + 100}, {}, "starting_after"),
        ):
            r = http.get(f"/v1/streams/{job}", params=params, headers=ACME | headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r, rest = _stream(
            http, "GET", f"/v1/streams/{job}", headers=ACME | {"last-event-id": f"{job}/{last}"}
        )
        assert r.status_code == 200 and rest == []  # after the last event: nothing more
        r, again = _stream(http, "GET", f"/v1/streams/{job}", headers=ACME)
        assert [e.data for e in again] == [e.data for e in events]
        time.sleep(RETENTION_S + 0.5)
        r = http.get(f"/v1/streams/{job}", headers=ACME)
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"


def test_an_open_server_resumes_only_with_the_token_and_answers_loopback_names_only() -> None:
    """``quantroute serve`` without tenants (the default): a stream's id alone replays
    nothing (it did, to anyone, for 300 s); a foreign ``Host`` (DNS rebinding) and a
    ``text/plain`` POST (a foreign page's form) are refused (issue 32, M4)."""
    with (
        serve_process(demo_model_dir().parent, "--engine-parallel", "1", ready_s=90) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        body = BODY | {"max_tokens": 8}
        r, events = _stream(http, "POST", "/v1/completions", json=body)
        job, token = r.headers["x-request-id"], r.headers["x-quantroute-stream-token"]
        assert events[-1].data == "[DONE]"
        r = http.get(f"/v1/streams/{job}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        r, again = _stream(
            http, "GET", f"/v1/streams/{job}", headers={"x-quantroute-stream-token": token}
        )
        assert [e.data for e in again] == [e.data for e in events]
        data = http.get("/dashboard/data").json()
        assert data["recent"] and all("request_id" not in e for e in data["recent"])
        r = http.get("/healthz", headers={"host": "rebound.evil.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        port = url.rpartition(":")[2]
        assert http.get("/healthz", headers={"host": f"localhost:{port}"}).status_code == 200
        r = http.post(
            "/v1/completions", content=json.dumps(body), headers={"content-type": "text/plain"}
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"

"""Structured logs: JSON lines carrying the request's id, trace id, tenant and branch; one
access line per request with its status, tokens, TTFT and duration; never the prompt or
the key."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qrtest import fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.observability import Tracing
from quantroute.observability.logs import make_handler

KEY = "sk-acme-very-secret"
PROMPT = "the prompt nobody may log"


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = make_handler("json", out)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield out
    root.removeHandler(handler)
    root.setLevel(old_level)


async def test_json_access_lines_name_the_request_and_never_its_prompt_or_key(
    tmp_path: Path, json_lines: io.StringIO
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  acme:\n    keys: [{KEY!r}]\n")
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"}, auth={"tenants_file": str(tenants)}
    )
    app = create_app(settings, fake_table())
    app.state.gateway.observer.tracing = Tracing(InMemorySpanExporter(), batch=False)
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "quality": "fast"}
    async with serving(app) as (client, _):
        ok = await client.post("/v1/completions", json=body, headers=auth)
        assert ok.status_code == 200
        missing = await client.post("/v1/completions", json=body | {"model": "nope"}, headers=auth)
        assert missing.status_code == 404
    text = json_lines.getvalue()
    assert PROMPT not in text and KEY not in text
    lines = [json.loads(line) for line in text.splitlines()]
    access = [line for line in lines if line["logger"] == "quantroute.access"]
    assert len(access) == 2
    first, second = access
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["tenant"] == "acme"
    assert first["branch"] == ok.headers["x-quantroute-branch"]
    assert len(first["trace_id"]) == 32
    assert first["status"] == 200 and first["completion_tokens"] == 3
    assert first["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert 0 < first["ttft_ms"] <= first["duration_ms"]
    assert second["status"] == 404 and second["error"] == "model_not_found"
    assert "ttft_ms" not in second


def test_auto_is_plain_on_a_terminal_and_json_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    record = logging.makeLogRecord({"name": "x", "levelname": "INFO", "msg": "hello"})
    tty, pipe = Tty(), io.StringIO()
    make_handler("auto", tty).handle(record)
    make_handler("auto", pipe).handle(record)
    assert tty.getvalue().rstrip().endswith("INFO x: hello")
    assert json.loads(pipe.getvalue()) == {
        "time": json.loads(pipe.getvalue())["time"],
        "level": "info",
        "logger": "x",
        "message": "hello",
    }

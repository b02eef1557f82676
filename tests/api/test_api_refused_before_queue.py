"""A request the server can never run is refused before the model's admission queue: its
400 does not wait behind other requests, does not take their place, and is not a 503
when the model is full. And a full model's 503s are logged once a second, not each."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from qrtest import fake_table, serving
from quantroute.api import errors
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

SCHEMA_400 = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": []}}}
TOOL_400 = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "string", "format": "email"}},
}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "x", "response_format": SCHEMA_400}, "response_format"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": SCHEMA_400},
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TOOL_400],
            "tool_choice": "required",
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
async def test_an_unenforceable_schema_is_a_400_while_the_model_is_full(
    path: str, body: dict[str, Any], param: str
) -> None:
    # one request at a time (64 slots x 1/64), no queue: a second waits for nothing, a 503
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        admission={"slots_factor": 1 / 64, "queue_size": 0},
    )
    table = fake_table({"f16": FakeEngine(token_delay_s=0.05)})
    async with serving(create_app(settings, table)) as (http, _):
        running = asyncio.create_task(
            http.post(
                "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 40}
            )
        )
        await asyncio.sleep(0.3)  # it holds the model's one place
        full = await http.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
        )
        assert full.status_code == 503  # the model is full: a request it could run waits
        refused = await http.post(path, json={"model": "tiny-llama", **body})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"].startswith(param)
        assert (await running).status_code == 200


async def test_shed_requests_are_one_warning_a_second_not_an_error_each(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full model sheds every request past its queue with a 503; each is in the access
    log already, so the error log says so once a second, at WARNING, and then how many it
    held back."""
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        admission={"slots_factor": 1 / 64, "queue_size": 0},
    )
    table = fake_table({"f16": FakeEngine(token_delay_s=0.05)})
    clock = {"now": 1000.0}
    monkeypatch.setattr(errors, "_SHED_LOG", errors._Throttle(clock=lambda: clock["now"]))
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
    async with serving(create_app(settings, table)) as (http, _):
        running = asyncio.create_task(http.post("/v1/completions", json=body | {"max_tokens": 40}))
        await asyncio.sleep(0.3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quantroute.api.errors"):
            for _ in range(40):
                assert (await http.post("/v1/completions", json=body)).status_code == 503
            clock["now"] += 1.5  # a second later: one more line, counting the 39 held back
            assert (await http.post("/v1/completions", json=body)).status_code == 503
        await running
    lines = [r for r in caplog.records if r.name == "quantroute.api.errors"]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.WARNING]
    assert "saturated" in lines[0].getMessage() and "more like it" not in lines[0].getMessage()
    assert "(39 more like it since the last such line)" in lines[1].getMessage()

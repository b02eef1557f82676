"""Schema, pattern and tool-grammar work is the client's to choose: it runs after the
tenant's limits, off the event loop, within a time bound, and once per schema
(issue #32, M3).

Before: a ``pattern`` class held the loop for seconds while the body was parsed, before
any limit (1 MiB: 5.3 s); a tenant over its limit got 400s and 200s, never a 429; a
refused schema was checked again each time it came.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.sec_loop_probe import healthz_timed
from qrtest import fake_table, live, serving
from quantroute.api import grammars
from quantroute.api.app import create_app
from quantroute.api.schemas import ChatCompletionRequest
from quantroute.config import load_settings
from quantroute.shaping import grammar

JSON = {"content-type": "application/json"}
CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "x"}],
}
TENANTS = """
tenants:
  one-a-minute:
    keys: ["sk-one"]
    requests_per_minute: 1
  two-a-minute:
    keys: ["sk-two"]
    requests_per_minute: 2
  busy:
    keys: ["sk-busy"]
  other:
    keys: ["sk-other"]
"""


def _format(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    }


def _key(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **JSON}


#: A class that took the old check quadratic time (each negated \d adds its 60-odd ranges,
#: merged again for every member): ~2 s of the event loop at 4,000 characters.
HEAVY_CLASS = _format({"type": "string", "pattern": "^[^" + "\\d" * 2000 + "]$"})
REFUSED = _format({"type": "integer", "minimum": 1})


def _app(tmp_path: Path | None = None, **limits: Any) -> Any:
    auth = {}
    if tmp_path is not None:
        (tmp_path / "tenants.yaml").write_text(TENANTS)
        auth = {"tenants_file": str(tmp_path / "tenants.yaml")}
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"}, auth=auth, limits={"max_tokens": 64, **limits}
    )
    return create_app(settings, fake_table())


async def test_a_tenant_over_its_limit_gets_429_before_its_schema_is_read(tmp_path: Path) -> None:
    async with serving(_app(tmp_path)) as (http, _):
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_key("sk-one"))
        assert r.status_code == 200, r.text
        for body in (REFUSED, HEAVY_CLASS):
            start = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=CHAT | body, headers=_key("sk-one"))
            assert r.status_code == 429, r.text
            assert time.perf_counter() - start < 0.5


async def test_a_refused_schema_counts_in_the_tenants_minute(tmp_path: Path) -> None:
    async with serving(_app(tmp_path)) as (http, _):
        for _ in range(2):
            r = await http.post("/v1/chat/completions", json=CHAT | REFUSED, headers=_key("sk-two"))
            assert (
                r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"
            )
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_key("sk-two"))
        assert r.status_code == 429, r.text


async def _while_timed(app: Any, send: Any) -> tuple[list[float], Any]:
    """``send(http)`` on a real server while ``/healthz`` is timed from another thread:
    the probe latencies and what ``send`` returned."""
    async with (
        live(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
        healthz_timed(port) as health,
    ):
        await asyncio.sleep(0.1)
        result = await send(http)
        await asyncio.sleep(0.1)
    return health, result


async def test_a_costly_pattern_is_checked_off_the_event_loop() -> None:
    async def send(http: httpx.AsyncClient) -> list[int]:
        statuses = []
        for _ in range(3):
            r = await http.post("/v1/chat/completions", json=CHAT | HEAVY_CLASS)
            statuses.append(r.status_code)
        return statuses

    health, statuses = await _while_timed(_app(), send)
    assert statuses == [200, 200, 200]
    assert len(health) >= 5 and max(health) < 0.5, max(health)


@pytest.fixture
def slow_convert(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The converter (llama.cpp's, which cannot look at the clock) sleeping ``seconds[0]``:
    a grammar whose compile holds its thread, and nothing else."""
    seconds = [0.0]
    real = grammar._convert

    def slow(schemas: Any) -> str:
        time.sleep(seconds[0])
        return real(schemas)

    monkeypatch.setattr(grammar, "_convert", slow)
    monkeypatch.setattr(grammar, "_MEMO", grammar._Memo(budget=1 << 20))
    return seconds


async def test_a_compile_past_its_wall_bound_is_a_400_and_the_loop_runs_on(
    slow_convert: list[float],
) -> None:
    slow_convert[0] = 1.5  # past 2 x 0.1 s + 1 s

    async def send(http: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        body = CHAT | _format({"type": "string", "maxLength": 3})
        r = await http.post("/v1/chat/completions", json=body)
        return r, time.perf_counter() - start

    health, (r, took) = await _while_timed(_app(compile_timeout_s=0.1), send)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "longer to compile" in error["message"]
    assert took > 1.1  # the wall bound: 2 x 0.1 s + 1 s
    assert max(health) < 0.5, max(health)  # the loop ran on while the thread slept


async def test_requests_wait_for_a_compile_slot_and_then_get_503(slow_convert: list[float]) -> None:
    slow_convert[0] = 0.6
    async with serving(_app(compile_timeout_s=0.2)) as (http, _):
        bodies = [CHAT | _format({"type": "string", "maxLength": n}) for n in (1, 2, 3)]
        answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=b) for b in bodies))
    statuses = sorted(r.status_code for r in answers)
    assert grammars.AT_ONCE == 2 and statuses == [200, 200, 503], [r.text for r in answers]
    shed = next(r for r in answers if r.status_code == 503)
    assert shed.headers["retry-after"] == "1"


async def test_a_tenant_holds_one_compile_slot_and_leaves_the_other_to_others(
    tmp_path: Path, slow_convert: list[float]
) -> None:
    """Before: one key sending costly schemas within its rate limit held both slots, and
    every other key's schema requests waited for them, then got 503s."""
    slow_convert[0] = 0.6
    mine = [CHAT | _format({"type": "string", "maxLength": n}) for n in (1, 2)]
    theirs = CHAT | _format({"type": "string", "maxLength": 3})
    async with serving(_app(tmp_path, compile_timeout_s=0.2)) as (http, _):
        answers = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=b, headers=_key("sk-busy")) for b in mine),
            http.post("/v1/chat/completions", json=theirs, headers=_key("sk-other")),
        )
    assert sorted(r.status_code for r in answers[:2]) == [200, 429], [r.text for r in answers]
    assert answers[2].status_code == 200, answers[2].text
    limited = next(r for r in answers[:2] if r.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    assert "compiling as many grammars as it may" in limited.json()["error"]["message"]


async def test_a_tenants_own_slots_are_kept_only_while_it_compiles(
    slow_convert: list[float],
) -> None:
    slow_convert[0] = 0.3
    work = grammars.Grammars(timeout_s=0.1)
    reqs = [
        ChatCompletionRequest.model_validate(CHAT | _format({"type": "string", "maxLength": n}))
        for n in (1, 2)
    ]
    outcomes = await asyncio.gather(*(work.of(r, "t") for r in reqs), return_exceptions=True)
    assert sorted(type(o).__name__ for o in outcomes) == ["RateLimitError", "str"]
    assert work._own == {}
    assert await work.of(reqs[0]) is not None and work._own == {}


async def test_a_schema_past_its_cpu_budget_is_a_400_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[int] = []
    real = grammar.check_schema

    def counting(schema: Any, where: str = "schema") -> None:
        checked.append(1)
        real(schema, where)

    monkeypatch.setattr(grammar, "check_schema", counting)
    monkeypatch.setattr(grammar, "_MEMO", grammar._Memo(budget=1 << 20))
    many = {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,8}[^\\d]?$"} for i in range(1900)}
    body = CHAT | _format({"type": "object", "properties": many})
    async with serving(_app(compile_timeout_s=0.002)) as (http, _):
        answers = [await http.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert [r.status_code for r in answers] == [400, 400, 400]
    errors = [r.json()["error"] for r in answers]
    assert all(e == errors[0] for e in errors)
    assert errors[0]["param"] == "response_format.json_schema"
    assert "takes longer to check than this server allows" in errors[0]["message"]
    assert checked == [1]  # the refusal came from the memo after the first


async def test_a_request_without_a_grammar_takes_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[int] = []
    real = grammars._bounded

    def counting(*args: Any) -> Any:
        ran.append(1)
        return real(*args)

    monkeypatch.setattr(grammars, "_bounded", counting)
    text = {"response_format": {"type": "text"}}
    unforced = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"oneOf": []}}}],
        "tool_choice": "auto",
    }
    async with serving(_app()) as (http, _):
        for extra in ({}, text, unforced):
            r = await http.post("/v1/chat/completions", json=CHAT | extra)
            assert r.status_code == 200, r.text
        assert ran == []
        r = await http.post(  # one fixed grammar, nothing the client chose: no thread either
            "/v1/chat/completions", json=CHAT | {"response_format": {"type": "json_object"}}
        )
        assert r.status_code == 200 and ran == []
        schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
        r = await http.post("/v1/chat/completions", json=CHAT | {"response_format": schema})
        assert r.status_code == 200 and ran == [1]

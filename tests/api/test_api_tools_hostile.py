"""Hostile tool and schema input: deep JSON in a tool call's arguments and counts that
would make a grammar huge get 4xx answers, never a 500, a stall or a dead worker."""

from __future__ import annotations

import time

import pytest

from qrtest import fake_app, serving
from quantroute.api.tools import _parse_block

DEEP = "[" * 50_000


async def test_deeply_nested_tool_call_arguments_are_not_a_500() -> None:
    body = {
        "model": "tiny-llama",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": DEEP},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code < 500, r.text
        assert (await http.get("/healthz")).status_code == 200


def test_a_model_reply_nested_too_deep_is_not_a_call() -> None:
    assert _parse_block('{"name": "f", "arguments": ' + DEEP + "}") is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 20_000},
        {"type": "array", "items": {"type": "null"}, "minItems": 40_000_000},
        {"type": "string", "pattern": "^a{0,100000}$"},
    ],
)
async def test_counts_that_would_make_a_huge_grammar_are_a_fast_400(schema: dict) -> None:
    body = {
        "model": "tiny-llama",
        "prompt": "x",
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    async with serving(fake_app()) as (http, _):
        started = time.perf_counter()
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert time.perf_counter() - started < 1.0  # refused before any grammar is built
        assert "at most" in r.json()["error"]["message"]

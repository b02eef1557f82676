"""Schemas that would stall or break a worker are a fast 400, named, before anything
reaches one: grammars llama.cpp's sampler cannot step in reasonable time (nested
repetitions, huge alternations and enums), lone surrogates anywhere in a schema or a
tool's parameters, and schemas no value could satisfy. The audit's own bodies included."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from qrtest import fake_app, serving

JSON = {"content-type": "application/json"}
CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "x"}],
}


def _format(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    }


def _tools(parameters: Any, choice: Any = "required", **function: Any) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, **function}}
    return {"tools": [tool], "tool_choice": choice}


ALTERNATION = "^(" + "|".join(["ab"] * 30_000) + ")$"
NESTED_ENUM = {"enum": [{"a": [i]} for i in range(20_000)]}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        # ((a?){256}){256}: 65,536 optional a's, each count within the old bounds
        (_format({"type": "string", "pattern": "^((a?){256}){256}$"}), "response_format", "nested"),
        (_format({"type": "string", "pattern": "^((a?){16}){17}$"}), "response_format", "open"),
        # 90,000 characters: refused for its length before any is read
        (_format({"type": "string", "pattern": ALTERNATION}), "response_format", "at most 8192"),
        (_format(NESTED_ENUM), "response_format", "at most 500 values"),
        (
            # 1,064 alternatives open at once, each enum within its bound
            _format({"anyOf": [{"enum": list(range(500))}, {"enum": list(range(500, 1000))},
                               {"type": "string", "pattern": "^(a|b|c|d|e|f|g|h)(x?){64}$"}]}),
            "response_format",
            "at once",
        ),
        (
            _tools({"type": "object", "properties": {"a": {"type": "string",
                    "pattern": "^((a?){256}){256}$"}}}),
            "tools",
            "tools[0].function.parameters.properties[0].pattern",
        ),
    ],
)  # fmt: skip
async def test_grammars_too_costly_to_sample_are_a_fast_named_400(
    extra: dict[str, Any], param: str, words: str
) -> None:
    async with serving(fake_app()) as (http, _):
        start = time.perf_counter()
        r = await http.post("/v1/chat/completions", json=CHAT | extra)
        took = time.perf_counter() - start
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith(param) and words in error["message"], error
        assert "ab|ab" not in r.text and '{"a"' not in r.text  # nothing of the client's
        assert took < 1.0


S = "\ud800"  # a lone surrogate, as json.loads reads "\ud800"
TOOL_PARAMETERS = "tools.0.function.parameters"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (_format({"type": "string", "pattern": f"^{S}$"}), "response_format.json_schema"),
        (_format({"enum": ["a", S]}), "response_format.json_schema"),
        (_format({"const": {"k": [S]}}), "response_format.json_schema"),
        (_format({"type": "object", "properties": {"\udc00": {}}}), "response_format.json_schema"),
        (_format({"type": "string", "description": S}), "response_format.json_schema"),
        (_format({"type": "string", "examples": [{S: 1}]}), "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "s", "description": S, "schema": {}}}},
            "response_format.json_schema.description",
        ),
        (_tools({"type": "object", "properties": {"a": {"enum": [S]}}}), TOOL_PARAMETERS),
        # with tool_choice auto nothing is forced, but the parameters reach the prompt
        (_tools({"type": "object", "properties": {S: {}}}, "auto"), TOOL_PARAMETERS),
        (_tools({"type": "object", "description": S}, "none"), TOOL_PARAMETERS),
        (_tools({"type": "object"}, "auto", description=S), "tools.0.function.description"),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_anywhere_in_a_schema_is_a_400(
    extra: dict[str, Any], param: str
) -> None:
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/chat/completions", content=json.dumps(CHAT | extra), headers=JSON)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "lone surrogates" in error["message"], error
        assert "\\ud800" not in error["message"].replace("(\\ud800-\\udfff)", "")
        ok = CHAT | _format({"type": "string", "pattern": "^[a-z]{2,4}$", "title": "\U0001f600"})
        assert (await http.post("/v1/chat/completions", json=ok)).status_code == 200


async def test_a_lone_surrogate_in_a_past_tool_call_is_a_400() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": "\ud800"}'},
    }
    body = CHAT | {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }  # fmt: skip
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/chat/completions", content=json.dumps(body), headers=JSON)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].endswith("function.arguments")


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "minLength": 10, "maxLength": 5}, "minLength is more than maxLength"),
        ({"type": "array", "items": {}, "minItems": 3, "maxItems": 2}, "minItems is more than"),
        ({"enum": "a"}, "enum must be a non-empty list"),
        ({"enum": []}, "enum must be a non-empty list"),
        ({"type": "string", "pattern": "^((a$"}, "a ( is not closed"),
        ({"type": "string", "pattern": "^a)$"}, "a ) closes no ("),
        ({"type": "string", "pattern": "^[ab$"}, "a [ is not closed"),
        ({"type": "string", "pattern": "^a{3,1}$"}, "n > m"),
        ({"type": "string", "pattern": "^a|b$"}, "outside parentheses"),
    ],
)
async def test_schemas_no_value_could_satisfy_are_a_400(schema: Any, words: str) -> None:
    async with serving(fake_app()) as (http, _):
        r = await http.post("/v1/chat/completions", json=CHAT | _format(schema))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("response_format") and words in error["message"]

"""Errors never echo the request: a marker planted where the client names things (an
unknown field's name, a ``response_format`` tag, a ``logit_bias`` key, a JSON schema's
type names, keywords, formats, property names and ``required`` entries) appears
nowhere in the answer, which is a 400 whose ``param`` names a field of the schema.

These are the cases a security audit found (``echo_probe.py``): each once answered
with the marker in ``message``, ``param`` or both.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi.exceptions import RequestValidationError
from pydantic import AnyUrl, TypeAdapter, ValidationError

from qrtest import fake_app, serving
from quantroute.api.errors import validation_error
from quantroute.errors import InvalidRequestError

in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the async tests share the app

M = "ZQXMARKER7731"
K = f"{M}-key"  # an unknown key no field could be named: never said back
CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
}
COMPLETION: dict[str, Any] = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 3}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serving(fake_app()) as (c, _):
        yield c


async def refused(client: httpx.AsyncClient, path: str, body: Any) -> dict[str, Any]:
    """The error of a 400 to ``body``, checked to hold the marker nowhere."""
    r = await client.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert M not in r.text, r.text
    assert all(M not in v for v in r.headers.values())
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    return error


# ---- unknown field names ---------------------------------------------------------------


@in_module_loop
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/chat/completions", CHAT),
        ("/v1/route/explain", COMPLETION),
        ("/v1/route/explain", CHAT),
    ],
)
@pytest.mark.parametrize("key", [K, f"x {M}", f"<b>{M}</b>", "x" * 65 + M])
async def test_an_unknown_top_level_field_that_no_field_could_be_called_is_not_named(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str
) -> None:
    error = await refused(client, path, body | {key: 1})
    assert error["param"] is None
    assert "not a parameter of this endpoint" in error["message"]


@in_module_loop
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", COMPLETION | {"frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", CHAT | {"colour_2": "x"}, "colour_2"),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": "hi", "mood": 1}]},
            "messages.0.mood",
        ),
        (
            "/v1/completions",
            COMPLETION | {"stream_options": {"model": "x"}},
            "stream_options.model",
        ),
    ],
)
async def test_an_unknown_field_with_a_plain_name_is_named_as_openai_names_it(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: not a parameter of ")
    assert '"x"' not in r.text  # the value is never said


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}


@in_module_loop
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/completions",
            COMPLETION | {"stream": True, "stream_options": {K: True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": "hi", K: 1}]},
            "messages.0",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [{"type": "function", "function": {"name": "f", K: 1}}]},
            "tools.0.function",
        ),
        (
            "/v1/completions",
            COMPLETION | {"response_format": {"type": "text", K: 1}},
            "response_format",
        ),
        (
            "/v1/completions",
            COMPLETION
            | {"response_format": {"type": "json_schema", "json_schema": {"name": "n", K: 1}}},
            "response_format.json_schema",
        ),
        (
            "/v1/completions",
            COMPLETION | {"response_format": SCHEMA_FORMAT | {K: 1}},
            "response_format",
        ),
    ],
)
async def test_an_unknown_nested_field_names_where_it_is_not_what(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = await refused(client, path, body)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    assert "field" in error["message"], error


@in_module_loop
async def test_a_known_field_in_the_wrong_place_is_not_named_either(
    client: httpx.AsyncClient,
) -> None:
    """``stream_options.model``: a plain name, named where it is."""
    body = COMPLETION | {"stream": True, "stream_options": {"model": "x"}}
    error = await refused(client, "/v1/completions", body)
    assert error["param"] == "stream_options.model"


# ---- the response_format tag, and other values pydantic's messages quote -----------------


@in_module_loop
@pytest.mark.parametrize("tag", [M, f"json_{M}", f"'{M}'"])
async def test_an_unknown_response_format_type_names_the_tags_not_the_value(
    client: httpx.AsyncClient, tag: str
) -> None:
    error = await refused(
        client, "/v1/completions", COMPLETION | {"response_format": {"type": tag}}
    )
    assert error["param"] == "response_format.type", error
    for known in ("text", "json_object", "json_schema"):
        assert known in error["message"], error


@in_module_loop
async def test_a_response_format_of_the_wrong_type_is_400(client: httpx.AsyncClient) -> None:
    error = await refused(client, "/v1/completions", COMPLETION | {"response_format": M})
    assert error["param"] == "response_format", error


@in_module_loop
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", COMPLETION | {"logit_bias": {M: 500}}, "logit_bias"),
        ("/v1/completions", COMPLETION | {"logit_bias": {M: M}}, "logit_bias"),
        ("/v1/completions", COMPLETION | {"logit_bias": {M: 1}}, "logit_bias"),
        ("/v1/completions", COMPLETION | {"model": 7, "prompt": M}, "model"),
        ("/v1/completions", COMPLETION | {"max_tokens": M}, "max_tokens"),
        ("/v1/completions", COMPLETION | {"stream": M}, "stream"),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": M, "content": M}]},
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": [{"type": M, "text": M}]}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", CHAT | {"tool_choice": M}, "tool_choice"),
        (
            "/v1/chat/completions",
            CHAT
            | {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", M: 1}]}]},
            "messages.0.content",  # a union: its first member (a string) answers
        ),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [{"type": "function", "function": {"name": f"{M} bad!"}}]},
            "tools.0.function.name",
        ),
    ],
)
async def test_a_bad_value_is_named_by_its_field_and_not_quoted(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = await refused(client, path, body)
    assert error["param"] is not None and error["param"].startswith(param), error


# ---- JSON schemas (response_format and forced tool calls) ----------------------------------


def _format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


OBJECT = {"type": "object"}
SCHEMAS: list[tuple[Any, str]] = [
    ({"type": M}, "not a JSON schema type"),
    ({"type": ["string", M]}, "not a JSON schema type"),
    ({"type": {M: 1}}, "not a JSON schema type"),
    ({M: 1}, "not a JSON schema keyword"),
    ({"type": "string", "format": M}, "date-time"),
    ({"type": "string", "format": [M]}, "date-time"),
    (OBJECT | {"properties": {"a": {"type": "string"}}, "required": ["a", M]}, "required[1]"),
    (OBJECT | {"properties": {M: {"minimum": 1}}}, "'minimum'"),
    (OBJECT | {"properties": {"a": {}, M: {"type": M}}}, "properties[1]"),
    ({"$ref": "#/$defs/x", "$defs": {"x": {"type": M}}}, "$defs[0]"),
    ({"$ref": "#/definitions/x", "definitions": {"x": {M: 1}}}, "definitions[0]"),
    (OBJECT | {"properties": {M: {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": M}}}, "type"),
    ({"$ref": f"#/$defs/{M}"}, "grammar"),
    ({"enum": [M, {"a": M}], M: 1}, "keyword"),
    ({"enum": [M], "items": {}}, "'items' beside 'enum'"),
]


@in_module_loop
@pytest.mark.parametrize(("schema", "words"), SCHEMAS)
async def test_a_schema_error_quotes_nothing_the_client_wrote(
    client: httpx.AsyncClient, schema: Any, words: str
) -> None:
    body = COMPLETION | {"response_format": _format(schema)}
    error = await refused(client, "/v1/completions", body)
    assert error["param"] is not None and error["param"].startswith("response_format"), error
    assert words in error["message"], error


@in_module_loop
@pytest.mark.parametrize(("schema", "words"), SCHEMAS)
async def test_a_tools_schema_error_quotes_nothing_the_client_wrote(
    client: httpx.AsyncClient, schema: Any, words: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = CHAT | {"tools": [tool], "tool_choice": "required"}
    error = await refused(client, "/v1/chat/completions", body)
    assert error["param"] == "tools", error
    assert words in error["message"], error


# ---- pydantic's messages, one by one ---------------------------------------------------------


def _rendered(error: dict[str, Any]) -> InvalidRequestError:
    return validation_error(RequestValidationError([error]))


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (uuid.UUID, f"0{M}"),
        (datetime.date, f"2024-{M}"),
        (datetime.datetime, f"2024-01-01T{M}"),
        (datetime.timedelta, f"P{M}"),
        (AnyUrl, f"http://{M}:99999999/"),
    ],
)
def test_messages_that_quote_the_input_are_replaced(kind: Any, value: str) -> None:
    """A parser's complaint (pydantic's ``{error}``) may quote the text: "invalid
    character: found `Z` at 1" for a UUID. It is left off."""
    with pytest.raises(ValidationError) as info:
        TypeAdapter(kind).validate_python(value)
    raised = info.value.errors()[0]
    assert ", " in raised["msg"]  # "Input should be a valid X, <the parser's complaint>"
    err = _rendered(dict(raised, loc=("body", "when")))
    assert err.param == "when" and err.message.startswith("when: Input should be a valid ")
    assert M not in err.message and ", " not in err.message and "`" not in err.message


def test_a_message_whose_context_holds_the_input_is_not_passed_on() -> None:
    """A type of pydantic's this module has no entry for, whose context was filled
    from the input (``error``, ``tag``...): its message is not trusted."""
    for ctx_key in ("error", "tag", "attribute"):
        error = {"type": "a_new_kind", "loc": ("body", "x"), "msg": f"bad {M}", "ctx": {ctx_key: M}}
        err = _rendered(error)
        assert M not in err.message and err.param == "x"
    # the schema's own words (a bound, the expected literals) are passed on
    bound = {"type": "less_than_equal", "loc": ("body", "x"), "msg": "Input should be <= 2"}
    assert _rendered(bound | {"ctx": {"le": 2}}).message == "x: Input should be <= 2"
    ours = {"type": "value_error", "loc": ("body", "x"), "msg": "Value error, needs y"}
    assert _rendered(ours | {"ctx": {"error": ValueError("needs y")}}).message == "x: needs y"


def test_an_unknown_field_deep_in_a_path_stops_at_the_last_named_part() -> None:
    error = {"type": "extra_forbidden", "loc": ("body", "a", 0, "b", K), "msg": "Extra inputs"}
    err = _rendered(error)
    assert err.param == "a.0.b" and M not in err.message
    assert err.message == "a.0.b: has a field that it does not take"
    top = _rendered({"type": "extra_forbidden", "loc": ("body", K), "msg": "Extra inputs"})
    assert top.param is None and M not in top.message
    named = _rendered({"type": "extra_forbidden", "loc": ("body", "a", 0, "b"), "msg": "Extra"})
    assert named.param == "a.0.b" and named.message == "a.0.b: not a parameter of a.0"

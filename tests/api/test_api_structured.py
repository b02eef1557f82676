"""Structured output on real llama.cpp workers: every sampled reply of the toy model
parses, and validates against its schema, because the grammar and the closing path
(``engines/llamacpp/constrained.py``) make it so, not because the model is good."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import pytest_asyncio

from qrtest import demo_model_dir, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "string", "format": "uuid"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "score": {"type": ["number", "null"]},
        "note": {"type": "string"},
    },
    "required": ["name", "age", "kind", "tags", "owner", "score"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "A pet, as JSON:"}]}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = load_settings(repo=demo_model_dir().parent, engine={"parallel": 4, "n_threads": 1})
    async with serving(create_app(settings)) as (c, _):
        yield c


async def _stream_contents(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (
                    choice["delta"].get("content") or ""
                )
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
    assert set(finish.values()) <= {"stop", "length"} and len(finish) == body.get("n", 1)
    return [texts[i] for i in sorted(texts)]


async def _contents(client: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    if body.get("stream"):
        return await _stream_contents(client, body)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == body.get("n", 1)
    assert {c["finish_reason"] for c in choices} <= {"stop", "length"}
    return [c["message"]["content"] for c in choices]


async def test_100_sampled_schema_replies_all_validate(client: httpx.AsyncClient) -> None:
    """Temperature 1, streamed and not, n 1 and 2, and budgets from roomy down to
    barely more than the schema's shortest value: every reply is a valid instance."""
    bodies = [
        CHAT
        | {
            "response_format": FORMAT,
            "temperature": 1.0,
            "seed": i,
            "max_tokens": (240, 160, 120)[i % 3],  # the shortest value is 116 tokens
            "n": 1 + i % 2,
            "stream": i % 4 >= 2,
        }
        for i in range(100)
    ]
    # At most two n=2 requests at a time: a request holds the slots of its choices that
    # started while it waits for the first token of the others (the runner's commit
    # point), so more n>1 requests than a worker has slots can wait on each other.
    sems = {1: asyncio.Semaphore(4), 2: asyncio.Semaphore(2)}

    async def one(body: dict[str, Any]) -> list[str]:
        async with sems[body["n"]]:
            return await _contents(client, body)

    replies = [text for texts in await asyncio.gather(*map(one, bodies)) for text in texts]
    assert len(replies) == 150
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for text in replies:
        validator.validate(json.loads(text))
    assert len(set(replies)) > 100  # sampled, not one canned answer


async def test_json_object_replies_parse(client: httpx.AsyncClient) -> None:
    for i in range(20):
        body = CHAT | {"response_format": {"type": "json_object"}, "seed": i, "max_tokens": 24}
        body |= {"stream": i % 2 == 1, "n": 1 + i % 2}
        for text in await _contents(client, body):
            assert isinstance(json.loads(text), dict)


async def test_text_format_is_plain_generation(client: httpx.AsyncClient) -> None:
    body = CHAT | {"max_tokens": 8, "temperature": 0}
    plain = await _contents(client, body)
    assert await _contents(client, body | {"response_format": {"type": "text"}}) == plain


async def test_a_budget_below_the_shortest_value_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json=CHAT | {"response_format": FORMAT, "max_tokens": 20}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "integer", "minimum": 3}, "'minimum'"),
        ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
        ({"type": "string", "format": "email"}, "'email'"),
        ({"type": "array", "uniqueItems": True, "items": {}}, "'uniqueItems'"),
        ({"type": "object", "properties": {}, "required": ["x"]}, "required[0]"),
    ],
)
async def test_unsupported_schema_features_are_named(
    client: httpx.AsyncClient, schema: dict[str, Any], words: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = await client.post("/v1/chat/completions", json=CHAT | {"response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"].startswith("response_format")


async def test_completions_take_a_schema_too(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 200, "response_format": FORMAT}
    r = await client.post("/v1/completions", json=body | {"seed": 3})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


COUNTRIES = ["US", "CA", "MX", "GB", "FR", "DE", "IT", "ES", "PT", "NL", "BE", "LU", "CH",
             "AT", "DK", "NO", "SE", "FI", "IS", "IE", "PL", "CZ", "SK", "HU", "RO", "BG",
             "GR", "TR", "CY", "MT", "SI", "HR", "RS", "BA", "ME", "AL", "MK", "UA", "MD",
             "LT", "LV", "EE", "JP", "KR", "CN", "IN", "AU", "NZ", "BR", "AR"]  # fmt: skip
#: The shape of a real structured-output schema: nested objects, arrays up to 50 items,
#: date and e-mail patterns, enums of about 50 values, optional and nullable fields.
#: (Patterns spell classes out, [0-9] and [.]: llama.cpp's converter copies regex
#: escapes such as \d and \. into the grammar, and llama.cpp's parser refuses them.)
REALISTIC: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "placed": {"type": "string", "format": "date"},
        "due": {"type": "string", "pattern": "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "contact": {
            "type": "object",
            "properties": {
                "email": {
                    "type": "string",
                    "pattern": "^[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,32}([.][a-z]{2,8}){1,3}$",
                },
                "phone": {"anyOf": [{"type": "string", "pattern": "^[+]?[0-9]{7,15}$"},
                                    {"type": "null"}]},
                "country": {"enum": COUNTRIES},
            },
            "required": ["email", "country"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer"},
                    "unit": {"enum": ["each", "box", "kg", "g", "l", "ml", "m", "cm"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                             "maxItems": 5},
                },
                "required": ["sku", "qty", "unit"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": [f"status_{i:02d}" for i in range(48)] + ["done", "cancelled"]},
        "note": {"type": ["string", "null"], "description": "free text"},
    },
    "required": ["order", "placed", "contact", "lines", "status"],
    "additionalProperties": False,
}  # fmt: skip


async def test_a_realistic_schema_is_accepted_and_every_reply_validates(
    client: httpx.AsyncClient,
) -> None:
    """Inside every bound on a grammar's cost (shaping/grammar.py) with room to spare."""
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": REALISTIC}}
    bodies = [
        CHAT | {"response_format": fmt, "temperature": 1.0, "seed": i, "max_tokens": 400}
        | {"stream": i % 2 == 1}
        for i in range(8)
    ]  # fmt: skip
    validator = jsonschema.Draft202012Validator(REALISTIC)
    for texts in await asyncio.gather(*(_contents(client, body) for body in bodies)):
        for text in texts:
            validator.validate(json.loads(text))


async def test_patterns_with_a_required_character_after_a_class_are_served(
    client: httpx.AsyncClient,
) -> None:
    """An e-mail's ``^[^@]+@[^@]+$``: the worker's greedy closing path stayed inside the
    first class for ever, so every such request was refused as too long for any budget;
    and ``.`` or a negated class may write ", \\ and control characters, escaped."""
    schema = {
        "type": "object",
        "properties": {
            "email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
            "name": {"type": "string", "pattern": "^.{1,12}$"},
        },
        "required": ["email", "name"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "who", "schema": schema}}
    bodies = [
        CHAT | {"response_format": fmt, "temperature": 1.0, "seed": i, "max_tokens": m}
        for i in range(6)
        for m in (120, 240)
    ]
    validator = jsonschema.Draft202012Validator(schema)
    for texts in await asyncio.gather(*(_contents(client, body) for body in bodies)):
        for text in texts:
            value = json.loads(text)
            validator.validate(value)
            assert re.fullmatch("[^@]+@[^@]+", value["email"])


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^((a?){256}){256}$"},  # wedged a worker for good
        {"type": "string", "pattern": "^(" + "|".join(["ab"] * 30_000) + ")$"},  # 56 s
        {"enum": [{"a": [i]} for i in range(20_000)]},  # over 60 s
        {"type": "string", "pattern": "^\ud800$"},  # the worker could not read its command
    ],
)
async def test_schemas_that_stalled_or_broke_a_worker_are_a_fast_400(
    client: httpx.AsyncClient, schema: dict[str, Any]
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    start = asyncio.get_running_loop().time()
    r = await client.post(
        "/v1/chat/completions",
        content=json.dumps(CHAT | {"response_format": fmt}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("response_format")
    assert asyncio.get_running_loop().time() - start < 1.0
    body = CHAT | {"max_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text  # every branch still serves

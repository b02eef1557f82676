"""Property tests over the request schemas, against the real app on fake engines.

Whatever a client sends — valid bodies, wrong types, numbers out of range,
subnormal or past every float, Unicode digits and lone surrogates, NaN and
Infinity literals, deep nesting, missing and unknown fields, hostile headers and
path parameters — the answer is a success or a 4xx in OpenAI's error shape
(a documented 503 where no branch can meet the request's bound), and no error
body or header repeats what the client planted in the request.

Bounded for ``make test``: each property runs a fixed number of examples.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from qrtest import ADMIN, fake_app, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARK = "«QRMARK»"  # planted in every hostile string; never in an answer
HEADER_MARK = "QRMARK-hdr"  # headers are ASCII
EXAMPLES = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serving(fake_app()) as (c, _):
        yield c


# ---- what an answer must be --------------------------------------------------------------------


def check_answer(r: httpx.Response) -> None:
    """A success or a 4xx in OpenAI's shape; a 503 only as documented; no echo."""
    if currently_in_test_context():  # the statistics of a property test
        event(f"status {r.status_code}")
    assert MARK not in r.text and HEADER_MARK not in r.text, r.text[:500]
    assert all(MARK not in v and HEADER_MARK not in v for v in r.headers.values())
    if r.status_code < 400:
        answer = r.json() if "json" in r.headers.get("content-type", "") else None
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict) and "prompt_tokens" in usage:  # a completion, not a stream
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert 0 <= cached <= usage["prompt_tokens"], usage
        return
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    if r.status_code == 503:  # infeasible: no branch meets the bound or the deadline
        assert error["code"] == "service_unavailable", error
        assert "retry-after" in r.headers
        return
    assert 400 <= r.status_code < 500, (r.status_code, error)
    assert error["type"] in {"invalid_request_error", "authentication_error", "permission_error"}


async def post_json(
    client: httpx.AsyncClient, path: str, body: Any, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals included
    sent = {k: v.encode() for k, v in (headers or {}).items()}  # UTF-8 bytes, as sent
    return await client.post(
        path, content=raw, headers={"content-type": "application/json", **sent}
    )


# ---- strategies --------------------------------------------------------------------------------

# Every character, lone surrogates included.
ANY_CHAR = st.characters(exclude_categories=())
HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)])
EDGE_FLOATS = st.sampled_from(
    [1e-320, 5e-324, -5e-324, -0.0, 1e308, -1e308, 2.0000000001, 1e-5, 100.00001, 0.1]
)


def marked_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(ANY_CHAR, max_size=12).map(lambda t: t + MARK),
        st.sampled_from(["²", "٣", "1²", "NaN", "Infinity", "1e400", " 5", "-1", "0x10"]).map(
            lambda t: t + MARK
        ),
    )


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    HUGE_INTS,
    st.floats(),  # nan and infinities included
    EDGE_FLOATS,
    marked_text(),
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(marked_text(), inner, max_size=3),
    max_leaves=8,
)


def deep(depth: int) -> Any:
    value: Any = MARK
    for i in range(depth):
        value = [value] if i % 2 else {MARK: value}
    return value


NESTED = st.integers(10, 200).map(deep)  # json.dumps recurses: deeper ones are raw bytes below
HOSTILE = st.one_of(ANY_JSON, NESTED)


NUMBER_0_2 = st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2, 1e-320, 5e-324]))
MODELS = st.sampled_from(["tiny-llama", "tiny-llama:f16", "tiny-llama:q8_0", "tiny-llama:q4_k_m"])
TEXT = st.one_of(st.text(max_size=40), marked_text())
STOP = st.text(min_size=1, max_size=20).map(lambda t: t + MARK)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.one_of(
            TEXT,
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                min_size=1,
                max_size=3,
            ),
        ),
    },
    optional={"name": st.text(max_size=20)},
)
QUALITY = st.one_of(
    st.sampled_from(["exact", "high", "balanced", "fast", " High ", "FAST"]),
    st.fixed_dictionaries(
        {}, optional={"max_kld": st.floats(0, 10), "min_top1": st.floats(0, 1)}
    ).filter(bool),
)
# Valid values, each alone and all together (the pairs that depend on each other are
# drawn together in ``bodies``).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "temperature": NUMBER_0_2,
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.just(5e-324)),
    "top_k": st.integers(0, 1000),
    "n": st.integers(1, 2),
    "stop": st.one_of(STOP, st.lists(STOP, max_size=4)),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "user": TEXT,
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=4),
    "ignore_eos": st.booleans(),
    "quality": QUALITY,
    "timeout": st.floats(0.001, 3600),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 10),
    "min_p": st.floats(0, 1),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
        ]
    ),
}
# Near misses: the right type just out of bounds, or a value that only looks right.
NEAR: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(
        marked_text(),
        st.sampled_from(
            ["", "tiny-llama:", ":f16", "a" * 300, "tiny-llama@v2", "tiny-llama@", "@v1:f16"]
        ),
    ),
    "messages": st.one_of(
        st.just([]),
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.one_of(st.sampled_from(["function", "User", ""]), marked_text()),
                    "content": st.one_of(st.none(), st.just([]), HOSTILE),
                    "name": st.text(min_size=65, max_size=70),
                    MARK: st.just(1),
                },
            ),
            min_size=1,
            max_size=3,
        ),
    ),
    "prompt": st.one_of(
        st.just([]),
        st.just([[]]),
        st.lists(st.one_of(st.integers(max_value=-1), HUGE_INTS), min_size=1),
        st.lists(st.integers(10**6, 2**31 - 1), min_size=1, max_size=3),  # out of vocabulary
    ),
    "max_tokens": st.one_of(st.sampled_from([0, -1, 65, 4097]), HUGE_INTS),
    "temperature": st.one_of(
        st.sampled_from([-5e-324, 2.0000000001, 1e308]), HUGE_INTS, st.floats()
    ),
    "top_p": st.one_of(st.sampled_from([0, 0.0, -0.0, 1.0000001]), HUGE_INTS, st.floats()),
    "top_k": st.one_of(st.sampled_from([-1, 1001]), HUGE_INTS, st.just(5.0)),
    "n": st.one_of(st.sampled_from([0, 3, 5]), HUGE_INTS),
    "stop": st.one_of(st.just(""), st.just([""]), st.lists(STOP, min_size=5, max_size=6)),
    "seed": st.one_of(st.sampled_from([2**64, -(2**63) - 1]), HUGE_INTS),
    "logit_bias": st.dictionaries(
        st.one_of(st.sampled_from(["²", "٣", "0" * 10, "1e3", "-1", " 1"]), marked_text()),
        st.one_of(st.floats(-100, 100), st.floats(), HUGE_INTS),
        min_size=1,
        max_size=3,
    ),
    "quality": st.one_of(
        marked_text(),
        st.dictionaries(
            st.sampled_from(["max_kld", "min_top1", MARK]),
            st.one_of(HUGE_INTS, st.floats(), st.booleans(), st.integers(), marked_text()),
            max_size=2,
        ),
    ),
    "timeout": st.one_of(
        st.sampled_from([0, 0.0009, 3601, 1e-320]), HUGE_INTS, st.floats(), marked_text()
    ),
    "presence_penalty": st.one_of(st.sampled_from([2.5, -2.01]), HUGE_INTS, st.floats()),
    "repetition_penalty": st.one_of(st.sampled_from([0, -1, 10.5]), HUGE_INTS, st.floats()),
    "min_p": st.one_of(st.sampled_from([-0.1, 1.5]), HUGE_INTS, st.floats()),
    "min_tokens": st.one_of(st.sampled_from([-1, 65]), HUGE_INTS),
    "response_format": st.one_of(
        HOSTILE,
        st.sampled_from(
            [
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": 1}}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": []}}},
                {"type": "json_schema", "json_schema": {"schema": {}}},
                {"type": "xml"},
            ]
        ),
    ),
    "tool_choice": st.one_of(
        st.sampled_from(["required", "any", {"type": "function", "function": {"name": "f"}}]),
        HOSTILE,
    ),
    "tools": st.one_of(st.just([]), HOSTILE),
    "max_completion_tokens": st.one_of(st.sampled_from([0, 65]), HUGE_INTS),
    "top_logprobs": st.sampled_from([-1, 21, 5]),
    "logprobs": st.one_of(st.sampled_from([6, -1]), HUGE_INTS),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "echo": st.just(True),
}


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> Any:
    """A valid body, then up to three mutations of it: a field's value made hostile
    (any JSON) or a near miss, a required field dropped, an unknown field added — or,
    now and then, a body that is not an object at all."""
    body: dict[str, Any] = {"model": draw(MODELS)}
    if chat:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=4))
    else:
        body["prompt"] = draw(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2)))
    body.update(draw(st.fixed_dictionaries({}, optional=VALID)))
    if not chat and isinstance(body["prompt"], list):
        body["n"] = 1
    limit = "max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"
    if draw(st.booleans()):
        body[limit] = draw(st.integers(1, 8))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if chat and draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 20))
    elif not chat and draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["hostile", "near", "near", "drop", "extra"]))
        if kind in ("hostile", "drop") and not body:
            kind = "extra"
        if kind == "hostile":
            body[draw(st.sampled_from(sorted(body)))] = draw(HOSTILE)
        elif kind == "near":
            name = draw(st.sampled_from(sorted(NEAR)))
            body[name] = draw(NEAR[name])
        elif kind == "drop":
            del body[draw(st.sampled_from(sorted(body)))]
        else:
            body[draw(marked_text())] = draw(ANY_JSON)
    if draw(st.integers(0, 19)) == 0:
        return draw(HOSTILE)
    return body


HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "x-quantroute-quality": st.one_of(
            st.sampled_from(["high", "fast", "max_kld=0.01", "max_kld=0.01,min_top1=0.9"]),
            HEADER_TEXT.map(lambda t: t + HEADER_MARK),
            st.sampled_from(["max_kld=1e999", "max_kld=" + "9" * 500, "min_top1=nan", "²"]),
        ),
        "x-quantroute-deadline-ms": st.one_of(
            st.integers(1, 3_600_000).map(str),
            HEADER_TEXT.map(lambda t: t + HEADER_MARK),
            st.sampled_from(["1e400", "9" * 500, "nan", "inf", "-5", "0x10", "1_000", "٣"]),
        ),
        "x-quantroute-user": st.one_of(
            HEADER_TEXT, HEADER_TEXT.map(lambda t: t + HEADER_MARK), st.just("u" * 300)
        ),
    },
)


# ---- the properties ----------------------------------------------------------------------------


@EXAMPLES
@given(body=bodies(chat=True), headers=HEADERS)
async def test_chat_bodies_never_500_nor_echo(
    client: httpx.AsyncClient, body: Any, headers: dict[str, str]
) -> None:
    check_answer(await post_json(client, "/v1/chat/completions", body, headers))


@EXAMPLES
@given(body=bodies(chat=False), headers=HEADERS)
async def test_completion_bodies_never_500_nor_echo(
    client: httpx.AsyncClient, body: Any, headers: dict[str, str]
) -> None:
    check_answer(await post_json(client, "/v1/completions", body, headers))


@EXAMPLES
@given(body=st.one_of(bodies(chat=True), bodies(chat=False)), headers=HEADERS)
async def test_route_explain_bodies_never_500_nor_echo(
    client: httpx.AsyncClient, body: Any, headers: dict[str, str]
) -> None:
    r = await post_json(client, "/v1/route/explain", body, headers)
    check_answer(r)
    if r.status_code == 200:
        assert r.json()["model"] == "tiny-llama"


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Bytes no JSON encoder would write: deep nesting, literals past every limit."""
    depth = draw(st.integers(1, 100_000))
    prefix = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "quality": '
    choices = [
        b"[" * depth + b"]" * depth,
        b"[" * depth,
        b'{"a":' * depth + b"1" + b"}" * depth,
        (prefix + "[" * depth + "]" * depth + "}").encode(),
        (prefix + "1" * draw(st.integers(300, 6000)) + "}").encode(),  # past int()'s digits
        (prefix + '{"max_kld": ' + "9" * 5000 + "}}").encode(),
        (prefix + '{"max_kld": 1e999}, "temperature": -Infinity}').encode(),
        (prefix + '"x", "temperature": NaN}').encode(),
        b'{"model": "tiny-llama", "prompt": "\\ud800' + MARK.encode() + b'"}',
        b"\xef\xbb\xbf" + (prefix + '"fast"}').encode(),  # a BOM
        (prefix + '"fast"}').encode("utf-16"),
        draw(st.binary(max_size=64)) + MARK.encode(),
        (prefix + '"fast"}').encode()[: draw(st.integers(0, 80))],
        b"",
    ]
    return draw(st.sampled_from(choices))


@settings(EXAMPLES, max_examples=100)
@given(
    raw=raw_bodies(),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/route/explain"]),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]
    ),
)
async def test_raw_bodies_never_500_nor_echo(
    client: httpx.AsyncClient, raw: bytes, path: str, content_type: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    check_answer(await client.post(path, content=raw, headers=headers))


def _quoted(segment: str) -> str:
    """A path segment percent-encoded byte by byte; a lone surrogate becomes bytes that
    are not UTF-8, as a hostile client would send them."""
    return quote(segment.encode("utf-8", "surrogatepass"), safe="")


PATH_TEXT = st.one_of(
    st.sampled_from(["sim:0", "cpu", "tiny-llama", "tiny-llama:f16", "tiny-llama:nope", ":", "::"]),
    marked_text(),
)


@settings(EXAMPLES, max_examples=100)
@given(
    device=PATH_TEXT,
    body=st.one_of(
        st.fixed_dictionaries({"bytes": st.one_of(st.integers(0, 1 << 30), HUGE_INTS, SCALARS)}),
        HOSTILE,
    ),
)
async def test_pressure_never_500_nor_echo(
    client: httpx.AsyncClient, device: str, body: Any
) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    r = await client.put(
        f"/admin/devices/{_quoted(device)}/pressure",
        content=raw,
        headers={"content-type": "application/json", **ADMIN},
    )
    check_answer(r)
    if r.status_code == 200:  # leave the device as the other properties expect it
        await client.put("/admin/devices/sim:0/pressure", json={"bytes": 0}, headers=ADMIN)


@settings(EXAMPLES, max_examples=60)
@given(branch=PATH_TEXT)
async def test_restart_never_500_nor_echo(client: httpx.AsyncClient, branch: str) -> None:
    check_answer(await client.post(f"/admin/branches/{_quoted(branch)}/restart", headers=ADMIN))


@settings(EXAMPLES, max_examples=60)
@given(model=st.one_of(MODELS, marked_text()))
async def test_model_retrieval_never_500_nor_echo(client: httpx.AsyncClient, model: str) -> None:
    r = await client.get(f"/v1/models/{_quoted(model)}")
    check_answer(r)
    assert r.status_code in (200, 404)


@settings(EXAMPLES, max_examples=60)
@given(
    path=st.sampled_from(
        ["/v1/models", "/v1/devices", "/readyz", "/healthz", "/metrics", "/admin/status", "/nope"]
    ),
    query=st.dictionaries(marked_text(), marked_text(), max_size=2),
    authorization=st.one_of(
        st.none(),
        st.just(ADMIN["authorization"]),
        HEADER_TEXT.map(lambda t: "Bearer " + t + HEADER_MARK),
    ),
)
async def test_get_endpoints_never_500_nor_echo(
    client: httpx.AsyncClient, path: str, query: dict[str, str], authorization: str | None
) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    params = {
        k.encode("utf-8", "surrogatepass").decode("utf-8", "replace"): v.encode(
            "utf-8", "surrogatepass"
        ).decode("utf-8", "replace")
        for k, v in query.items()
    }
    check_answer(await client.get(path, params=params, headers=headers))

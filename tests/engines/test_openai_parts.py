"""The remote engine's pure parts: bounded SSE splitting (``sse``), what upstream chunks
say (``chunks``), what each server is sent (``payload``) and load from Prometheus text
(``load``). Tables for the cases each promises; properties for what must hold of any
input a server may send."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quantroute.engines.base import (
    ChatInput,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from quantroute.engines.openai.chunks import MESSAGE_CHARS, count, error_of, finish_of, tokens_of
from quantroute.engines.openai.load import METRIC_NAMES, RemoteLoad, parse_load
from quantroute.engines.openai.payload import EXTENSIONS, SERVERS, body_of
from quantroute.engines.openai.sse import EventSplitter, EventTooLarge
from quantroute.errors import InvalidRequestError

# -- sse --------------------------------------------------------------------------------


def _split_all(stream: bytes, cuts: list[int], max_bytes: int = 1 << 20) -> list[bytes]:
    s = EventSplitter(max_bytes)
    events: list[bytes] = []
    last = 0
    for cut in sorted(cuts):
        events += s.feed(stream[last:cut])
        last = cut
    events += s.feed(stream[last:])
    return events + s.close()


@pytest.mark.parametrize(
    ("stream", "events"),
    [
        (b'data: {"a": 1}\n\n', [b'{"a": 1}']),
        (b"data:x\n\n", [b"x"]),  # the space after the colon is optional
        (b"data:  x\n\n", [b" x"]),  # and only one is dropped
        (b"data: a\ndata: b\n\n", [b"a\nb"]),  # lines of one event join with \n
        (b"data: a\r\n\r\ndata: b\r\n\r\n", [b"a", b"b"]),  # CRLF line ends
        (b": a comment\nevent: x\nid: 3\nretry: 10\ndata: y\n\n", [b"y"]),  # only data counts
        (b"event: ping\n\n", []),  # an event without data is no event
        (b"\n\n\ndata: z\n\n\n\n", [b"z"]),  # blank lines between events
        (b"data: [DONE]\n\n", [b"[DONE]"]),
        (b"data: last", [b"last"]),  # the stream ended without its blank line
        (b"data: last\n", [b"last"]),
        (b"event: half", []),  # a partial line that is not data
        (b"data:\n\n", [b""]),  # an empty data line is an (empty) event
    ],
)
def test_event_splitter(stream: bytes, events: list[bytes]) -> None:
    assert _split_all(stream, []) == events
    assert _split_all(stream, list(range(len(stream)))) == events  # one byte at a time


def test_a_line_over_the_bound_raises_before_it_ends() -> None:
    s = EventSplitter(1024)
    s.feed(b"data: " + b"x" * 1000)
    with pytest.raises(EventTooLarge):
        s.feed(b"x" * 100)  # no newline yet: the line alone is over


def test_an_event_over_the_bound_raises_though_each_line_fits() -> None:
    s = EventSplitter(1024)
    with pytest.raises(EventTooLarge):
        s.feed(b"".join(b"data: " + b"y" * 200 + b"\n" for _ in range(6)))


def test_events_at_the_bound_pass() -> None:
    s = EventSplitter(1024)
    assert s.feed(b"data:" + b"z" * 1024 + b"\n\n") == [b"z" * 1024]
    # later events start afresh
    assert s.feed(b"data:" + b"w" * 1024 + b"\n\n") == [b"w" * 1024]


# any payload without a CR (a lone CR ends a line in SSE, which OpenAI servers never send)
_payload = st.binary(max_size=64).filter(lambda b: b"\r" not in b)
_noise = st.sampled_from([b": keep-alive", b"event: message", b"id: 7", b"retry: 100", b":"])


@st.composite
def _sse_streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A valid SSE byte stream of OpenAI's kind and the data of its events."""
    payloads = draw(st.lists(_payload, max_size=12))
    end = draw(st.sampled_from([b"\n", b"\r\n"]))
    out = b""
    for payload in payloads:
        for noise in draw(st.lists(_noise, max_size=2)):
            out += noise + end
        for line in payload.split(b"\n"):
            out += b"data: " + line + end
        out += end
    return out, payloads


@settings(max_examples=300, deadline=None)
@given(_sse_streams(), st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_any_split_of_a_stream_gives_the_same_events(
    pair: tuple[bytes, list[bytes]], cuts: list[int]
) -> None:
    stream, payloads = pair
    cuts = [c % (len(stream) + 1) for c in cuts]
    assert _split_all(stream, []) == payloads
    assert _split_all(stream, cuts) == payloads


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.binary(max_size=300), max_size=30),
    st.integers(min_value=16, max_value=256),
)
def test_the_splitter_never_holds_more_than_its_bound(chunks: list[bytes], bound: int) -> None:
    """Whatever the bytes: each feed either returns events or raises ``EventTooLarge``,
    and what it keeps between feeds (the partial line, the data so far) is within the
    bound."""
    s = EventSplitter(bound)
    for chunk in chunks:
        try:
            events = s.feed(chunk)
        except EventTooLarge:
            return
        assert all(len(e) - e.count(b"\n") <= bound for e in events)
        assert len(s._buffer) <= bound
        assert sum(map(len, s._data)) <= bound


def test_empty_data_lines_count_toward_the_bound() -> None:
    s = EventSplitter(1024)
    with pytest.raises(EventTooLarge):
        s.feed(b"data:\n" * 3000)  # an event of 2,999 newlines, 3,000 lines held


def test_splitting_is_linear_in_an_event_s_lines() -> None:
    import time

    s = EventSplitter(1 << 20)
    started = time.perf_counter()
    s.feed(b"data:x\n" * 8000)  # 56 kB: one read of a socket
    assert time.perf_counter() - started < 0.5


# -- chunks -----------------------------------------------------------------------------


def _chat(content: object, **choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, **choice}]}


def _text(text: object, **choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, **choice}]}


CHAT_LOGPROBS = {
    "content": [
        {"token": "He", "id": 5, "logprob": -0.5, "top_logprobs": [
            {"token": "He", "id": 5, "logprob": -0.5}, {"token": "Hi", "id": 6, "logprob": -1.5}]},
        {"token": "llo", "id": 9, "logprob": -0.25, "top_logprobs": []},
    ]
}  # fmt: skip
LEGACY_LOGPROBS = {
    "tokens": ["He", "llo"],
    "token_logprobs": [-0.5, None],
    "top_logprobs": [{"He": -0.5, "Hi": -1.5}, None],
}


@pytest.mark.parametrize(
    ("event", "chat", "tokens"),
    [
        (_chat("Hi"), True, [TokenEvent("Hi", -1)]),
        (_text("Hi"), False, [TokenEvent("Hi", -1)]),
        (_chat(""), True, []),  # nothing added
        (_chat(None), True, []),  # the role-only first chunk
        (_chat(7), True, []),  # a number is no text
        (_text("Hi"), True, []),  # a completion's chunk read as chat: nothing
        ({"choices": []}, True, []),  # the usage chunk
        ({"choices": "x"}, True, []),
        ({"choices": [3]}, False, []),
        ({}, False, []),
        (  # one logprobs entry: the chunk's text with its logprob
            _chat("Hello", logprobs={"content": CHAT_LOGPROBS["content"][:1]}),
            True,
            [TokenEvent("Hello", 5, -0.5, "He", ((5, "He", -0.5), (6, "Hi", -1.5)))],
        ),
        (  # entries that make up the text: one event each
            _chat("Hello", logprobs=CHAT_LOGPROBS),
            True,
            [
                TokenEvent("He", 5, -0.5, "He", ((5, "He", -0.5), (6, "Hi", -1.5))),
                TokenEvent("llo", 9, -0.25, "llo", ()),
            ],
        ),
        (  # entries that do not make up the text: the text whole, without them
            _chat("Help", logprobs=CHAT_LOGPROBS),
            True,
            [TokenEvent("Help", -1)],
        ),
        (  # the legacy completions arrays; a missing logprob is None
            _text("Hello", logprobs=LEGACY_LOGPROBS),
            False,
            [
                TokenEvent("He", -1, -0.5, "He", ((-1, "He", -0.5), (-1, "Hi", -1.5))),
                TokenEvent("llo", -1, None, "llo", ()),
            ],
        ),
        (  # llama-server's completions send chat's content list, with ids
            _text("Hello", logprobs=CHAT_LOGPROBS),
            False,
            [
                TokenEvent("He", 5, -0.5, "He", ((5, "He", -0.5), (6, "Hi", -1.5))),
                TokenEvent("llo", 9, -0.25, "llo", ()),
            ],
        ),
        (  # a logprob of the wrong type is -inf, an id of the wrong type -1
            _chat("Hi", logprobs={"content": [{"token": "Hi", "id": "x", "logprob": "y"}]}),
            True,
            [TokenEvent("Hi", -1, -math.inf, "Hi", ())],
        ),
    ],
)
def test_tokens_of(event: dict[str, Any], chat: bool, tokens: list[TokenEvent]) -> None:
    assert tokens_of(event, chat) == tokens


@pytest.mark.parametrize(
    ("event", "finish"),
    [
        ({"choices": [{"finish_reason": "stop"}]}, FinishReason.STOP),
        ({"choices": [{"finish_reason": "length"}]}, FinishReason.LENGTH),
        ({"choices": [{"finish_reason": "tool_calls"}]}, FinishReason.STOP),
        ({"choices": [{"finish_reason": "content_filter"}]}, FinishReason.STOP),
        ({"choices": [{"finish_reason": "something new"}]}, FinishReason.STOP),
        ({"choices": [{"finish_reason": None}]}, None),
        ({"choices": [{"finish_reason": 1}]}, None),
        ({"choices": []}, None),
        ({"choices": ["stop"]}, None),
        ({}, None),
    ],
)
def test_finish_of(event: dict[str, Any], finish: FinishReason | None) -> None:
    assert finish_of(event) is finish


@pytest.mark.parametrize(
    ("raw", "message", "code"),
    [
        (
            b'{"error": {"message": "too long", "code": "context_length_exceeded"}}',
            "too long",
            "context_length_exceeded",
        ),
        (b'{"error": {"message": "m", "code": 400}}', "m", None),  # a number is no code
        (b'{"error": {"message": "m", "code": "' + b"c" * 65 + b'"}}', "m", None),  # too long
        (b'{"message": "flat"}', "flat", None),  # some servers' flat shape
        (b'{"error": "just text"}', "no reason given", None),
        (b'{"error": {"message": 5}}', "no reason given", None),
        (b"not json", "no reason given", None),
        (b"\xff\xfe", "no reason given", None),
        (b"[1, 2]", "no reason given", None),
        (b"", "no reason given", None),
    ],
)
def test_error_of(raw: bytes, message: str, code: str | None) -> None:
    assert error_of(raw) == (message, code)


def test_error_of_cuts_the_message_short() -> None:
    message, _ = error_of(json.dumps({"error": {"message": "m" * 10_000}}).encode())
    assert message == "m" * MESSAGE_CHARS


@pytest.mark.parametrize(
    ("value", "default", "out"),
    [(3, 0, 3), (0, 9, 0), (-1, 9, 9), ("3", 9, 9), (None, 9, 9), (2.0, 9, 9)],
)
def test_count(value: object, default: int, out: int) -> None:
    assert count(value, default) == out


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)
# shapes near the real ones, with any value anywhere
_keys = st.sampled_from(
    ["choices", "delta", "content", "text", "logprobs", "tokens", "token_logprobs",
     "top_logprobs", "token", "id", "logprob", "finish_reason", "usage"]
)  # fmt: skip
_near = st.recursive(
    st.none() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(_keys, _near, max_size=4)
    | st.dictionaries(st.text(), _json)
    | st.builds(
        lambda text, logprobs: {
            "choices": [{"delta": {"content": text}, "text": text, "logprobs": logprobs}]
        },
        st.text(min_size=1, max_size=3),
        st.dictionaries(_keys, _near, max_size=4),
    )
)
@example({"choices": [{"text": "a", "logprobs": {"tokens": 3}}]})
def test_chunk_readers_never_raise_on_any_json(event: dict[str, Any]) -> None:
    for chat in (True, False):
        for token in tokens_of(event, chat):
            assert isinstance(token.text, str) and token.text
    assert finish_of(event) in (None, *FinishReason)


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(_text("a", logprobs={"tokens": 3}), id="tokens-int"),
        pytest.param(
            _text("a", logprobs={"tokens": ["a"], "token_logprobs": {"x": 1}}),
            id="token_logprobs-dict",
        ),
        pytest.param(
            _text("a", logprobs={"tokens": ["a"], "top_logprobs": 5}),
            id="top_logprobs-int",
        ),
        pytest.param(
            _chat("a", logprobs={"content": [{"top_logprobs": 5}]}),
            id="chat-top_logprobs-int",
        ),
        pytest.param(_chat("a", logprobs={"content": "x"}), id="content-str"),
        pytest.param(_chat("a", logprobs=[1, 2]), id="logprobs-list"),
        pytest.param(_text("a", logprobs={"tokens": [5], "token_logprobs": ["x"]}), id="lp-str"),
    ],
)
def test_a_logprobs_field_of_the_wrong_type_is_as_good_as_absent(event: dict[str, Any]) -> None:
    chat = "delta" in event["choices"][0]
    assert "".join(t.text for t in tokens_of(event, chat)) == "a"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | _json.map(lambda v: json.dumps(v).encode()))
def test_error_of_never_raises(raw: bytes) -> None:
    message, code = error_of(raw)
    assert isinstance(message, str) and len(message) <= MESSAGE_CHARS
    assert code is None or (isinstance(code, str) and len(code) <= 64)


def test_error_of_takes_deeply_nested_json() -> None:
    assert error_of(b"[" * 100_000) == ("no reason given", None)


# -- payload ----------------------------------------------------------------------------

CHAT = ChatInput(messages=({"role": "user", "content": "hi"},))


def _request(chat: bool = True, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        "r1",
        "rendered prompt",
        SamplingParams(**sampling),
        chat=CHAT if chat else None,
    )


def test_a_chat_request_goes_with_its_messages() -> None:
    path, body = body_of(_request(max_tokens=9, temperature=0.0), "m", "vllm")
    assert path == "/chat/completions"
    assert body == {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "temperature": 0.0,
    }


def test_a_completion_goes_with_its_prompt_text_or_ids() -> None:
    path, body = body_of(_request(chat=False), "m", "llama-server")
    assert (path, body["prompt"]) == ("/completions", "rendered prompt")
    ids = GenerationRequest("r", "text", SamplingParams(), prompt_ids=(1, 2, 3))
    assert body_of(ids, "m", "vllm")[1]["prompt"] == [1, 2, 3]


def test_openai_itself_gets_max_completion_tokens_for_chat() -> None:
    assert body_of(_request(max_tokens=5), "gpt", "openai")[1]["max_completion_tokens"] == 5
    assert "max_tokens" not in body_of(_request(max_tokens=5), "gpt", "openai")[1]
    assert body_of(_request(False, max_tokens=5), "gpt", "openai")[1]["max_tokens"] == 5


def test_fit_context_sends_no_max_tokens() -> None:
    body = body_of(_request(fit_context=True), "m", "vllm")[1]
    assert "max_tokens" not in body and "max_completion_tokens" not in body


@pytest.mark.parametrize(
    ("sampling", "fields"),
    [
        ({"top_p": 0.5}, {"top_p": 0.5}),
        ({"seed": 7}, {"seed": 7}),
        ({"seed": 2**64 - 1}, {"seed": -1}),  # an unsigned 64-bit seed goes signed
        ({"stop": ("a", "b")}, {"stop": ["a", "b"]}),
        ({"presence_penalty": 0.5, "frequency_penalty": -0.5},
         {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
        ({"logit_bias": ((12, 5.0),)}, {"logit_bias": {"12": 5.0}}),
    ],
)  # fmt: skip
def test_openai_sampling_fields_are_forwarded(
    sampling: dict[str, Any], fields: dict[str, Any]
) -> None:
    for server in SERVERS:
        body = body_of(_request(**sampling), "m", server)[1]
        assert {k: body[k] for k in fields} == fields
    assert "top_p" not in body_of(_request(), "m", "vllm")[1]  # defaults are not sent


@pytest.mark.parametrize("field", sorted(EXTENSIONS))
@pytest.mark.parametrize("server", SERVERS)
def test_an_extension_goes_under_its_name_or_is_refused(field: str, server: str) -> None:
    default, names = EXTENSIONS[field]
    value: Any = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 3,
                  "ignore_eos": True}[field]  # fmt: skip
    assert value != default
    request = _request(**{field: value})
    if server in names:
        body = body_of(request, "m", server)[1]
        assert body[names[server]] == value
    else:
        with pytest.raises(InvalidRequestError) as info:
            body_of(request, "m", server)
        assert info.value.param == field
        assert server in str(info.value)


def test_llama_server_names_repetition_penalty_its_own_way() -> None:
    body = body_of(_request(repetition_penalty=1.3), "m", "llama-server")[1]
    assert body["repeat_penalty"] == 1.3 and "repetition_penalty" not in body


def test_tools_are_refused_for_a_remote_branch() -> None:
    tools = ({"type": "function", "function": {"name": "f"}},)
    request = GenerationRequest("r", "p", chat=ChatInput(CHAT.messages, tools=tools))
    with pytest.raises(InvalidRequestError) as info:
        body_of(request, "m", "vllm")
    assert info.value.param == "tools"


def test_response_format_goes_with_a_chat_request() -> None:
    fmt = {"type": "json_object"}
    request = GenerationRequest("r", "p", chat=ChatInput(CHAT.messages, response_format=fmt))
    assert body_of(request, "m", "vllm")[1]["response_format"] == fmt


@pytest.mark.parametrize(
    ("chat", "sampling", "fields"),
    [
        (True, {"logprobs": True}, {"logprobs": True}),
        (True, {"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
        (False, {"logprobs": True, "top_logprobs": 2}, {"logprobs": 2}),
        (False, {"logprobs": True}, {"logprobs": 1}),
    ],
)
def test_logprobs_are_asked_in_each_endpoint_s_shape(
    chat: bool, sampling: dict[str, Any], fields: dict[str, Any]
) -> None:
    body = body_of(_request(chat, **sampling), "m", "vllm")[1]
    assert {k: body.get(k) for k in fields} == fields


def test_logprobs_are_refused_by_a_branch_whose_server_returns_none() -> None:
    with pytest.raises(InvalidRequestError) as info:
        body_of(_request(logprobs=True), "m", "openai", logprobs=False)
    assert info.value.param == "logprobs"
    body_of(_request(), "m", "openai", logprobs=False)  # without logprobs: fine


@settings(max_examples=200, deadline=None)
@given(
    st.booleans(),
    st.sampled_from(SERVERS),
    st.builds(
        SamplingParams,
        max_tokens=st.integers(1, 4096),
        temperature=st.floats(0, 2),
        top_p=st.floats(0.01, 1),
        top_k=st.integers(0, 100),
        seed=st.none() | st.integers(0, 2**64 - 1),
        stop=st.lists(st.text(min_size=1, max_size=4), max_size=4).map(tuple),
        min_p=st.floats(0, 1),
        repetition_penalty=st.floats(0.5, 2),
        ignore_eos=st.booleans(),
    ),
)
def test_every_body_is_json_and_holds_only_what_its_server_takes(
    chat: bool, server: str, sampling: SamplingParams
) -> None:
    request = GenerationRequest("r", "p", sampling, chat=CHAT if chat else None)
    try:
        _, body = body_of(request, "m", server)
    except InvalidRequestError as exc:  # only for an extension the server does not take
        assert exc.param in EXTENSIONS and server not in EXTENSIONS[exc.param][1]
        return
    assert json.loads(json.dumps(body, allow_nan=False)) == body
    assert body["model"] == "m" and body["stream"] is True
    assert -(2**63) <= body.get("seed", 0) < 2**63
    for field, (default, names) in EXTENSIONS.items():
        value = getattr(sampling, field)
        if value != default:
            assert body[names[server]] == value
        elif server in names:
            assert names[server] not in body  # a default is not sent


# -- load -------------------------------------------------------------------------------

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:kv_cache_usage_perc{model_name="m"} 0.5
"""
LLAMA_SERVER = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
llamacpp:kv_cache_usage_ratio 0.25
llamacpp:prompt_tokens_total 70
"""
SGLANG = 'sglang:num_running_reqs{tp_rank="0"} 7\nsglang:num_queue_reqs{tp_rank="0"} 0\n'
QUANTROUTE = 'quantroute_model_running_requests{model="a"} 1\nquantroute_queue_depth 5\n'


@pytest.mark.parametrize(
    ("text", "load"),
    [
        (VLLM, RemoteLoad("vllm", 5, 4, 0.5)),  # label sets are summed
        (LLAMA_SERVER, RemoteLoad("llama-server", 2, 1, 0.25)),
        (SGLANG, RemoteLoad("sglang", 7, 0, None)),
        (QUANTROUTE, RemoteLoad("quantroute", 1, 5, None)),
        ("vllm:num_requests_waiting 2\n", RemoteLoad("vllm", 0, 2, None)),  # one is enough
        ("vllm:num_requests_running 1 1700000000000\n", RemoteLoad("vllm", 1, 0, None)),
        ('vllm:num_requests_running{a="x y",b="}"} 4\n', RemoteLoad("vllm", 4, 0, None)),
        ("vllm:num_requests_running -3\n", RemoteLoad("vllm", 0, 0, None)),  # never negative
        ("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 7\n",
         RemoteLoad("vllm", 1, 0, 1.0)),  # a ratio past 1 is 1
        ("vllm:num_requests_running NaN\nvllm:num_requests_running +Inf\n"
         "vllm:num_requests_running 2\n", RemoteLoad("vllm", 2, 0, None)),
        ("vllm:num_requests_running_total 9\n", None),  # a longer name is another metric
        ("vllm:num_requests_running\n", None),  # no value
        ("vllm:num_requests_running abc\n", None),
        ("# vllm:num_requests_running 3\n", None),
        ("", None),
        ("http_requests_total 5\n", None),
    ],
)  # fmt: skip
def test_parse_load(text: str, load: RemoteLoad | None) -> None:
    assert parse_load(text) == load


_names = st.sampled_from(sorted({n for names in METRIC_NAMES.values() for n in names if n}))
_lines = st.one_of(
    st.text(max_size=40),
    st.tuples(_names, st.text(max_size=10), st.text(max_size=12)).map(lambda t: " ".join(t)),
    st.tuples(_names, st.floats() | st.integers(-(10**30), 10**30)).map(lambda t: f"{t[0]} {t[1]}"),
    st.tuples(_names, st.text(max_size=10), st.floats()).map(lambda t: f"{t[0]}{{{t[1]}}} {t[2]}"),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_lines, max_size=12).map("\n".join))
def test_parse_load_never_raises_and_stays_in_range(text: str) -> None:
    load = parse_load(text)
    if load is not None:
        assert load.server in METRIC_NAMES
        assert load.running >= 0 and load.waiting >= 0
        assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0

"""The compatibility suite: the official ``openai`` client through every field docs/api.md
documents, whole and streamed, against ``quantroute serve`` on the demo (real llama.cpp
workers). Each case asks one field of one endpoint and checks what that field promises, on
the whole answer and on the stream put back together; greedy cases must give the same text
both ways."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from e2e.test_e2e_openai import _serving

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BRANCH = "tiny-llama:q8_0"  # pinned: every case on one worker, so greedy text is comparable
CHAT = [{"role": "user", "content": "Write a function."}]
PROMPT = "def main():\n"


@dataclass
class Answer:
    """One choice's outcome, from a whole response or a stream put together."""

    text: str = ""
    finish: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # chat: content entries; completions: top
    tokens: list[str] = field(default_factory=list)  # completions: tokens
    usage: Any = None


@dataclass(frozen=True)
class Case:
    name: str
    chat: bool
    args: dict[str, Any]
    check: Callable[[dict[int, Answer]], None]
    greedy: bool = True  # the same text whole and streamed


def _chat_answers(c: openai.OpenAI, args: dict[str, Any], stream: bool) -> dict[int, Answer]:
    kwargs = {"model": BRANCH, "messages": CHAT, "max_tokens": 12, "temperature": 0, **args}
    if "max_completion_tokens" in args:  # one of the two
        del kwargs["max_tokens"]
    out: dict[int, Answer] = {}
    if not stream:
        r = c.chat.completions.create(**kwargs)
        for ch in r.choices:
            a = out.setdefault(ch.index, Answer(usage=r.usage))
            a.text, a.finish = ch.message.content or "", ch.finish_reason
            a.tool_calls = [t.model_dump() for t in ch.message.tool_calls or []]
            a.logprobs = list(ch.logprobs.content or []) if ch.logprobs else []
        return out
    usage = None
    with c.chat.completions.create(stream=True, **kwargs) as s:
        for chunk in s:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                a = out.setdefault(ch.index, Answer())
                a.text += ch.delta.content or ""
                a.finish = ch.finish_reason or a.finish
                for t in ch.delta.tool_calls or []:
                    while len(a.tool_calls) <= t.index:
                        a.tool_calls.append({"function": {"name": "", "arguments": ""}})
                    fn = a.tool_calls[t.index]["function"]
                    fn["name"] += t.function.name or "" if t.function else ""
                    fn["arguments"] += t.function.arguments or "" if t.function else ""
                if ch.logprobs and ch.logprobs.content:
                    a.logprobs += ch.logprobs.content
    for a in out.values():
        a.usage = usage
    return out


def _completion_answers(c: openai.OpenAI, args: dict[str, Any], stream: bool) -> dict[int, Answer]:
    kwargs = {"model": BRANCH, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **args}
    out: dict[int, Answer] = {}
    if not stream:
        r = c.completions.create(**kwargs)
        for ch in r.choices:
            a = out.setdefault(ch.index, Answer(usage=r.usage))
            a.text, a.finish = ch.text, ch.finish_reason
            if ch.logprobs:
                a.tokens, a.logprobs = ch.logprobs.tokens or [], ch.logprobs.top_logprobs or []
        return out
    usage = None
    with c.completions.create(stream=True, **kwargs) as s:
        for chunk in s:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                a = out.setdefault(ch.index, Answer())
                a.text += ch.text
                a.finish = ch.finish_reason or a.finish
                if ch.logprobs:
                    a.tokens += ch.logprobs.tokens or []
                    a.logprobs += ch.logprobs.top_logprobs or []
    for a in out.values():
        a.usage = usage
    return out


def _one(check: Callable[[Answer], None]) -> Callable[[dict[int, Answer]], None]:
    def run(answers: dict[int, Answer]) -> None:
        assert set(answers) == {0}
        check(answers[0])

    return run


def _length(n: int) -> Callable[[Answer], None]:
    def check(a: Answer) -> None:
        assert a.finish == "length"
        assert a.usage is None or a.usage.completion_tokens == n

    return check


def _json_object(a: Answer) -> None:
    assert isinstance(json.loads(a.text), dict)


def _json_schema(a: Answer) -> None:
    value = json.loads(a.text)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def _tool_call(a: Answer) -> None:
    assert a.finish == "tool_calls"
    (call,) = a.tool_calls
    assert call["function"]["name"] == "lookup"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


def _chat_logprobs(k: int) -> Callable[[Answer], None]:
    def check(a: Answer) -> None:
        assert len(a.logprobs) == 8
        for entry in a.logprobs:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == k

    return check


def _completion_logprobs(k: int) -> Callable[[Answer], None]:
    def check(a: Answer) -> None:
        assert len(a.tokens) == len(a.logprobs) == 8
        for token, top in zip(a.tokens, a.logprobs, strict=True):
            # the sampled token is always there, so up to k + 1 (vLLM's, OpenAI's)
            assert token in top and k <= len(top) <= k + 1

    return check


def _two_choices(answers: dict[int, Answer]) -> None:
    assert set(answers) == {0, 1}
    assert all(a.finish in ("stop", "length") for a in answers.values())


def _stops_before(text: str) -> Callable[[Answer], None]:
    def check(a: Answer) -> None:
        assert text not in a.text

    return check


def _usage_on_stream(a: Answer) -> None:
    assert a.usage is not None and a.usage.completion_tokens > 0 and a.usage.prompt_tokens > 0


def _one_character(a: Answer) -> None:
    """A +100 bias on one token makes greedy decoding that token every time."""
    assert a.finish == "length" and len(set(a.text)) == 1


def _ok(a: Answer) -> None:
    assert a.finish in ("stop", "length")


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]
LONG = {"extra_body": {"ignore_eos": True}}

CASES = [
    Case("max_tokens", True, {"max_tokens": 5, **LONG}, _one(_length(5))),
    Case("max_completion_tokens", True, {"max_completion_tokens": 6, **LONG}, _one(_length(6))),
    Case("completions max_tokens", False, {"max_tokens": 7, **LONG}, _one(_length(7))),
    Case("temperature 0", True, {"temperature": 0}, _one(_ok)),
    Case("seeded sampling", True, {"temperature": 0.9, "seed": 7}, _one(_ok)),
    Case("top_p", False, {"temperature": 0.8, "top_p": 0.5, "seed": 3}, _one(_ok)),
    Case("top_k", False, {"temperature": 0.8, "seed": 3, "extra_body": {"top_k": 5}}, _one(_ok)),
    Case("min_p", True, {"temperature": 0.8, "seed": 3, "extra_body": {"min_p": 0.2}}, _one(_ok)),
    Case("penalties", True, {"presence_penalty": 1.5, "frequency_penalty": 1.0}, _one(_ok)),
    Case("repetition_penalty", False, {"extra_body": {"repetition_penalty": 1.3}}, _one(_ok)),
    Case("n", True, {"n": 2, "temperature": 0.9, "seed": 11}, _two_choices),
    Case("completions n", False, {"n": 2, "temperature": 0.9, "seed": 11}, _two_choices),
    Case("stop", True, {"stop": ["\n"], "max_tokens": 24}, _one(_stops_before("\n"))),
    Case("completions stop", False, {"stop": ["("], "max_tokens": 24}, _one(_stops_before("("))),
    Case("logit_bias", False, {"logit_bias": {"120": 100}, **LONG}, _one(_one_character)),
    Case("ignore_eos", True, {"max_tokens": 9, **LONG}, _one(_length(9))),
    Case("min_tokens", True, {"extra_body": {"min_tokens": 4}}, _one(_ok)),
    Case(
        "chat logprobs", True, {"logprobs": True, "max_tokens": 8, **LONG}, _one(_chat_logprobs(0))
    ),
    Case(
        "top_logprobs",
        True,
        {"logprobs": True, "top_logprobs": 3, "max_tokens": 8, **LONG},
        _one(_chat_logprobs(3)),
    ),
    Case(
        "completions logprobs 0",
        False,
        {"logprobs": 0, "max_tokens": 8, **LONG},
        _one(_completion_logprobs(0)),
    ),
    Case(
        "completions logprobs 2",
        False,
        {"logprobs": 2, "max_tokens": 8, **LONG},
        _one(_completion_logprobs(2)),
    ),
    Case(
        "stream_options",
        True,
        {"stream_options": {"include_usage": True}},
        _one(_usage_on_stream),
        # (whole answers carry usage anyway; the option is only sent with stream below)
    ),
    Case("user", True, {"user": "someone"}, _one(_ok)),
    Case(
        "json_object",
        True,
        {"response_format": {"type": "json_object"}, "max_tokens": 64},
        _one(_json_object),
    ),
    Case(
        "json_schema",
        True,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
            "max_tokens": 64,
        },
        _one(_json_schema),
    ),
    Case(  # an extension on completions (the client has no parameter for it)
        "completions json_schema",
        False,
        {
            "extra_body": {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA},
                }
            },
            "max_tokens": 64,
        },
        _one(_json_schema),
    ),
    Case(
        "tools",
        True,
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            "parallel_tool_calls": False,
            "max_tokens": 96,
        },
        _one(_tool_call),
    ),
    Case("quality", True, {"extra_body": {"quality": "exact"}}, _one(_ok)),
    Case("timeout (deadline)", True, {"extra_body": {"timeout": 60}}, _one(_ok)),
    Case("priority", False, {"extra_body": {"priority": -1}}, _one(_ok)),
    Case("prompt list", False, {"prompt": ["a", "b"]}, _two_choices),
    Case("prompt token ids", False, {"prompt": [100, 101, 102]}, _one(_ok)),
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with _serving("--engine-parallel", "4") as pair:
        yield pair


@pytest.fixture
def client(server: tuple[str, subprocess.Popen[bytes]]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_documented_field_whole_and_streamed(client: openai.OpenAI, case: Case) -> None:
    ask = _chat_answers if case.chat else _completion_answers
    args = {k: v for k, v in case.args.items() if k != "stream_options"}
    whole = ask(client, args, stream=False)
    streamed = ask(client, case.args, stream=True)
    case.check(whole)
    case.check(streamed)
    if case.greedy:
        assert {i: a.text for i, a in whole.items()} == {i: a.text for i, a in streamed.items()}


def test_an_unknown_field_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BRANCH, messages=CHAT, max_tokens=2, extra_body={"frobnicate": "x" * 64}
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "frobnicate"
    assert "xxxx" not in json.dumps(body)


def test_health_and_version(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    """``/health`` answers as ``/readyz`` does, for the probes that expect vLLM's or
    llama-server's; ``/version`` names the version and the llama.cpp build."""
    base = server[0]
    health, ready = httpx.get(f"{base}/health"), httpx.get(f"{base}/readyz")
    assert health.status_code == ready.status_code == 200
    version = httpx.get(f"{base}/version").json()
    assert version["version"] and version["llama_cpp"]

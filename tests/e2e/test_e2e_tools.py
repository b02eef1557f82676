"""Tools, model retrieval, token prompts and vocabulary checks against ``quantroute serve``
(a real process on the demo model), with the official ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from e2e.test_e2e_openai import _serving

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
FORCED: Any = {"type": "function", "function": {"name": "get_weather"}}
QUESTION: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with _serving("--engine-parallel", "4", "--engine-n-ctx", "2048") as (url, _):
        yield url


@pytest.fixture
def client(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_call(call: Any, name: str = "get_weather") -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
        assert isinstance(args["city"], str) and len(args["city"]) <= 20
    return dict(args)


def _streamed(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A streamed completion assembled as the openai client's own helper does."""
    state = ChatCompletionStreamState()
    options = {"include_usage": True}
    for chunk in client.chat.completions.create(stream=True, stream_options=options, **kwargs):
        state.handle_chunk(chunk)
    try:
        return state.get_final_completion()
    except openai.LengthFinishReasonError as exc:  # the helper refuses to parse these
        return exc.completion


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_conversation(client: openai.OpenAI, stream: bool) -> None:
    create = (lambda **kw: _streamed(client, **kw)) if stream else client.chat.completions.create
    tools = [WEATHER, TIME]
    first = create(
        model="tiny-llama", messages=QUESTION, tools=tools, tool_choice=FORCED,
        temperature=1.0, seed=7, max_tokens=120,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    _check_call(call)
    messages: Any = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in choice.message.tool_calls
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = create(model="tiny-llama", messages=messages, tools=tools, max_tokens=16, seed=1)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and the tool's answer reached the prompt: the second turn's is longer by them
    assert first.usage is not None and second.usage is not None
    grown = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown >= len('{"temp": 21}') + len(call.function.arguments), grown


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_parallel_calls_always_parse(client: openai.OpenAI, stream: bool) -> None:
    create = (lambda **kw: _streamed(client, **kw)) if stream else client.chat.completions.create
    for seed in range(6):
        reply = create(
            model="tiny-llama", messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=seed % 2 == 0, temperature=1.0, seed=seed, max_tokens=150, n=2,
        )  # fmt: skip
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            calls = choice.message.tool_calls
            assert calls and (len(calls) == 1 or seed % 2 == 0)
            for call in calls:
                _check_call(call, call.function.name)
            assert len({c.id for c in calls}) == len(calls)


def test_tool_choice_none_and_bad_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny-llama", messages=QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny-llama", messages=QUESTION, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="minimum"):
        bad = json.loads(json.dumps(WEATHER))
        bad["function"]["parameters"]["properties"]["city"] = {"type": "integer", "minimum": 0}
        client.chat.completions.create(
            model="tiny-llama", messages=QUESTION, tools=[bad], tool_choice="required"
        )


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.object == "model"
    assert {(b["precision"], b["engine"]) for b in model.model_extra["branches"]} == {
        ("f16", "llamacpp"),
        ("q8_0", "llamacpp"),
        ("q4_k_m", "llamacpp"),
        ("f16", "onnxruntime"),
        ("int8", "onnxruntime"),
        ("int4", "onnxruntime"),
    }
    branch = client.models.retrieve("tiny-llama:q8_0")
    assert branch.id == "tiny-llama:q8_0" and branch.model_extra["parent"] == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_prompt_shapes(client: openai.OpenAI, base: str) -> None:
    many = client.completions.create(model="tiny-llama", prompt=["def ", "class "], n=2,
                                     max_tokens=4, seed=1)  # fmt: skip
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    ids = client.completions.create(model="tiny-llama", prompt=[1, 102, 103], max_tokens=4)
    assert ids.usage.prompt_tokens == 3
    lists = client.completions.create(model="tiny-llama", prompt=[[1, 102], [1, 103, 104]],
                                      max_tokens=3, temperature=0)  # fmt: skip
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 5
    for prompt in ([1, 354], [[1, 2], [99999]]):
        r = httpx.post(f"{base}/v1/completions",
                       json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_logit_bias_outside_the_vocabulary_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-llama", messages=QUESTION, logit_bias={"354": 5}, max_tokens=2
        )
    assert err.value.body["param"] == "logit_bias"  # type: ignore[index]
    ok = client.chat.completions.create(
        model="tiny-llama", messages=QUESTION, logit_bias={"353": 5}, max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_penalties_and_vllm_sampling_fields(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="tiny-llama", prompt="def ", max_tokens=12, seed=3, presence_penalty=1.5,
        frequency_penalty=-0.5,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 12, "ignore_eos": False},
    )  # fmt: skip
    assert reply.usage.completion_tokens == 12  # min_tokens: no end before 12

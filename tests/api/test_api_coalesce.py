"""A reader that lags behind the engine gets the tokens that piled up in one chunk per
choice (one SSE write), with nothing lost: the text, the usage and one logprob entry per
token."""

from __future__ import annotations

import json

import pytest

from qrtest import fake_app, serving
from quantroute.api.render import ResponseRenderer
from quantroute.api.sse import _chunks
from quantroute.engines.base import FinishEvent, FinishReason, TokenEvent


def _data(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("chat", [False, True])
async def test_piled_up_tokens_go_out_together_and_add_up(chat: bool, n: int) -> None:
    async with serving(fake_app()) as (http, _):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        logprobs = {"logprobs": True} if chat else {"logprobs": 0}
        body = {"model": "tiny-llama:q4_k_m", "max_tokens": 64, "n": n} | logprobs | prompt
        whole = (await http.post(path, json=body)).json()
        r = await http.post(
            path, json=body | {"stream": True, "stream_options": {"include_usage": True}}
        )
        assert r.status_code == 200
        events = _data(r.text)
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 64 * n
        for index in range(n):
            chunks = [e["choices"][0] for e in events if e["choices"]]
            chunks = [c for c in chunks if c["index"] == index]
            if chat:
                text = "".join(c["delta"].get("content", "") for c in chunks)
                entries = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["content"]]
                expected = whole["choices"][index]["message"]["content"]
            else:
                text = "".join(c["text"] for c in chunks)
                entries = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["tokens"]]
                expected = whole["choices"][index]["text"]
            assert text == expected and len(entries) == 64
            tokens = len([c for c in chunks if c["finish_reason"] is None]) - chat  # the role
            assert tokens < 64  # the fake engine is instant: the tokens piled up
        ids = [line for line in r.text.splitlines() if line.startswith("id: ")]
        assert len(ids) == len(events) + 1  # every event keeps its own id ([DONE] too)
        assert [int(line.rpartition("/")[2]) for line in ids] == list(range(len(ids)))


class _FakeRun:
    def __init__(self, kind: str = "completion", include_usage: bool = False) -> None:
        from types import SimpleNamespace

        self.job = SimpleNamespace(
            id="j", kind=kind, requests=[0, 1], include_usage=include_usage, n=1, tools=False
        )
        self.branch = SimpleNamespace(id="m:q4_k_m", artifact=SimpleNamespace(sha256="0" * 64))
        self.prompt_tokens = [1, 1]


def test_a_batch_groups_only_consecutive_tokens_of_one_choice() -> None:
    renderer = ResponseRenderer(_FakeRun())  # type: ignore[arg-type]
    tok = [TokenEvent(c, ord(c)) for c in "abcd"]
    batch = [(0, tok[0]), (0, tok[1]), (1, tok[2]), (0, tok[3])]
    batch.append((0, FinishEvent(FinishReason.LENGTH, 1, 3)))
    chunks = [json.loads(data) for data in _chunks(renderer, batch)]
    out = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks]
    assert out == [(0, "ab"), (1, "c"), (0, "d"), (0, "")]
    assert [c.completion_tokens for c in renderer.choices] == [3, 1]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(
    "texts", [["a"], ["he", "llo"], ['"q"\\', "\n\t\x00"], ["é", "日本", "🙂"]]
)
def test_a_token_chunk_from_its_template_is_the_bytes_the_dict_encodes_to(
    kind: str, include_usage: bool, texts: list[str]
) -> None:
    """The hot path writes a plain chunk from a per-choice template; it must be exactly what
    encoding the chunk's dict gives, and count the same tokens."""
    from quantroute.api.render import encode

    fast = ResponseRenderer(_FakeRun(kind, include_usage))  # type: ignore[arg-type]
    slow = ResponseRenderer(_FakeRun(kind, include_usage))  # type: ignore[arg-type]
    fast.created = slow.created
    events = [TokenEvent(t, 7) for t in texts]
    for index in (1, 0, 1):
        body = slow.tokens_chunk(index, events)
        assert body is not None
        assert fast.tokens_data(index, events) == encode(body)
    assert [c.completion_tokens for c in fast.choices] == [
        c.completion_tokens for c in slow.choices
    ]
    assert [c.text for c in fast.choices] == [c.text for c in slow.choices]
    assert fast.tokens_data(0, [TokenEvent("", 9)]) is None  # held back: no chunk at all

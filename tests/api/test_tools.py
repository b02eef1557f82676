"""Tool calls read out of a model's text, whole and streamed piece by piece, and the
messages a template gets."""

from __future__ import annotations

import json

import pytest

from quantroute.api.tools import Tool, ToolCallStream, split_calls, template_messages

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("hello", "hello", []),
        (CALL, "", ["f"]),
        ("before " + CALL + "\n" + CALL, "before ", ["f", "f"]),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('<tool_call>{"name": 1}</tool_call>', '<tool_call>{"name": 1}</tool_call>', []),
        ('unfinished <tool_call>{"name"', 'unfinished <tool_call>{"name"', []),
        ("a < b <tool_", "a < b <tool_", []),
    ],
)
def test_split_calls(text: str, content: str, names: list[str]) -> None:
    got_content, calls = split_calls(text)
    assert got_content == content and [c.name for c in calls] == names
    for call in calls:
        assert json.loads(call.arguments) == {"x": 1} and call.id.startswith("call_")


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_streamed_pieces_give_what_the_whole_gives(size: int) -> None:
    text = "hi " + CALL + "\n" + CALL + " bye"
    stream = ToolCallStream()
    content, calls = "", []
    for i in range(0, len(text), size):
        piece_content, new = stream.feed(text[i : i + size])
        assert "<tool" not in piece_content  # never shown, then taken back
        content += piece_content
        calls += new
    content += stream.flush()
    assert content == "hi  bye" and len(calls) == 2


def test_parallel_false_keeps_the_first_call() -> None:
    assert len(split_calls(CALL + CALL, parallel=False)[1]) == 1


def test_default_format_messages() -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "f"}})
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    out, tools = template_messages(messages, [tool], template=None)
    assert tools is None and out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2]["content"] == CALL
    assert out[3] == {"role": "tool", "content": "<tool_response>42</tool_response>"}
    native, tools = template_messages(messages, [tool], template="{{ tools }}")
    assert tools and native[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}

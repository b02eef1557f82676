"""Tools (function calling): the request's schemas, the messages a chat template sees,
and the model's tool calls read back out of its text, whole or streamed.

The tools reach the model through its chat template. A GGUF template that reads
``tools`` gets them as OpenAI sends them, with assistant ``tool_calls`` (their
arguments as objects) and ``tool`` messages as they are. Any other template (the
default one included) gets quantroute's default format, as a system message::

    You can call functions. To call one, answer with only
    <tool_call>{"name": "<function name>", "arguments": {<its arguments>}}</tool_call>
    (one such line per call). The functions:
    {"name": ..., "description": ..., "parameters": {...}}

A past call is written back the same way in its assistant turn, and a ``tool``
message becomes the turn ``<tool_response>...</tool_response>`` (role ``tool``
for the default template, ``user`` for a model's own).

Whatever the template, the model's calls are read as ``<tool_call>{json}</tool_call>``
blocks (the format of Hermes/Qwen templates too); text outside them is the
message's content. ``tool_choice`` ``required`` or a named function is forced by a
grammar (``engines.grammar.tool_call_grammar``), so those always parse and their
arguments match the function's parameters.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from quantroute.engines.stops import partial_suffix
from quantroute.shaping.grammar import (
    SURROGATES,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    lone_surrogates,
)

__all__ = [
    "FunctionDef",
    "NamedToolChoice",
    "ParsedCall",
    "Tool",
    "ToolCallIn",
    "ToolCallStream",
    "encodable",
    "split_calls",
    "template_messages",
]

STRICT = ConfigDict(extra="forbid", strict=True)  # request models: typed, nothing extra
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
_IN_STRINGS = "strings must not hold lone surrogates (\\ud800-\\udfff)"  # as api.schemas


def encodable(value: Any) -> Any:
    """A string, or a JSON value's keys and strings, with no lone surrogate (``"\\ud800"``):
    no encoder can write one out, and a worker handed one could not read its command.
    Refused here, before any grammar, prompt or queue, as ``api.schemas`` refuses them in
    the request's other strings."""
    if lone_surrogates(value):
        raise ValueError(_IN_STRINGS if isinstance(value, str) else SURROGATES)
    return value


class FunctionDef(BaseModel):
    model_config = STRICT
    name: Name
    description: Annotated[str, AfterValidator(encodable)] | None = Field(None, max_length=1 << 16)
    # every key and string, whatever tool_choice is: they reach the prompt, or a grammar
    parameters: Annotated[dict[str, Any], AfterValidator(encodable)] | None = None
    strict: bool | None = None  # always enforced when the call is forced

    @property
    def schema_(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(BaseModel):
    model_config = STRICT
    name: Name


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: _FunctionName


class _CalledFunction(BaseModel):
    model_config = STRICT
    name: Name
    # JSON text, as OpenAI sends it
    arguments: Annotated[str, AfterValidator(encodable)] = Field(max_length=1 << 20)


class ToolCallIn(BaseModel):
    """A call in an earlier assistant message."""

    model_config = STRICT
    id: Annotated[str, AfterValidator(encodable)] = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: _CalledFunction


# ---- the template's messages ---------------------------------------------------------


def _call_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's depth, too
        return text  # not JSON: pass it on as the client wrote it


def template_messages(
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    *,
    template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name``, as
    the request had them) and ``tools`` for ``template`` (``None``: the default one)."""
    native = template is not None and "tools" in template
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments(c["function"]["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            m["content"] = m.get("content") or ""
            out.append(m)
        return out, [t.model_dump() for t in tools] if tools else None
    out = []
    if tools:
        lines = [
            "You can call functions. To call one, answer with only",
            f'{TOOL_CALL_OPEN}{{"name": "<function name>", "arguments": {{<its arguments>}}}}'
            f"{TOOL_CALL_CLOSE}",
            "(one such line per call). The functions:",
        ]
        lines += [
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description or "",
                    "parameters": t.function.schema_,
                },
                ensure_ascii=False,
            )
            for t in tools
        ]
        out.append({"role": "system", "content": "\n".join(lines)})
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [
                _call_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ]
            content = "\n".join([content, *calls] if content else calls)
        role = m["role"]
        if role == "tool":
            content = f"<tool_response>{content}</tool_response>"
            role = "tool" if template is None else "user"
        out.append({"role": role, "content": content})
    return out, None


# ---- the model's calls ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _parse_block(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # model output nested past the parser's depth
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], text)


@dataclass(slots=True)
class ToolCallStream:
    """Text pieces in; content and calls out as soon as they are known. Text that may be
    the start of ``<tool_call>`` is held back; a block that does not parse is content.
    With ``parallel`` false, calls after the first are dropped."""

    parallel: bool = True
    calls: list[ParsedCall] = field(default_factory=list)
    _held: str = ""
    _after_call: bool = False  # newlines right after a call separate calls: not content

    def feed(self, piece: str) -> tuple[str, list[ParsedCall]]:
        text = self._held + piece
        content: list[str] = []
        new: list[ParsedCall] = []
        while True:
            if self._after_call:
                text = text.lstrip("\n")
                self._after_call = not text
            start = text.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = partial_suffix(text, TOOL_CALL_OPEN)
                content.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            end = text.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                content.append(text[:start])
                self._held = text[start:]
                break
            content.append(text[:start])
            block = text[start : end + len(TOOL_CALL_CLOSE)]
            call = _parse_block(text[start + len(TOOL_CALL_OPEN) : end])
            if call is None:
                content.append(block)
            elif self.parallel or not self.calls:
                self.calls.append(call)
                new.append(call)
            self._after_call = call is not None
            text = text[end + len(TOOL_CALL_CLOSE) :]
        return "".join(content), new

    def flush(self) -> str:
        """What is still held back, as content (an unfinished block is text)."""
        held, self._held = self._held, ""
        return held


def split_calls(text: str, *, parallel: bool = True) -> tuple[str, list[ParsedCall]]:
    """All of a reply: its content (text outside call blocks) and its calls."""
    stream = ToolCallStream(parallel)
    content, calls = stream.feed(text)
    return content + stream.flush(), calls

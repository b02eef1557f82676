"""HTTP request schemas: every field typed (strictly) and bounded.

Bounds that depend on settings (``max_tokens``, ``n``, ``stop``) are checked
by :func:`check_limits`; the rest here. Unknown fields are rejected, so a
misspelt parameter is a 400 rather than silently ignored. Strings may hold any
Unicode but lone surrogates (``"\\ud800"``), which no encoder can write out.

:func:`parse_body` parses a raw JSON body into one of them, for the
endpoints that read their bodies themselves (the generation endpoints and
``/v1/route/explain``, which takes either kind: :func:`parse_generation_body`):
at most :data:`MAX_JSON_DEPTH` levels of nesting, checked before the parser
recurses.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from quantroute.api.structured import ResponseFormat
from quantroute.api.tools import STRICT, NamedToolChoice, Tool, ToolCallIn
from quantroute.config import LimitSettings
from quantroute.errors import FieldError, InvalidRequestError

__all__ = [
    "MAX_JSON_DEPTH",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
    "check_limits",
    "check_vocabulary",
    "parse_body",
    "parse_generation_body",
]

MAX_JSON_DEPTH = 64
_Model = TypeVar("_Model", bound=BaseModel)
_SURROGATE = re.compile("[\ud800-\udfff]")
_TOKEN_ID = re.compile(r"[0-9]{1,9}")  # ASCII digits: str.isdigit() takes "²" and "٣"


def _encodable(value: str) -> str:
    if _SURROGATE.search(value):
        raise ValueError("strings must not hold lone surrogates (\\ud800-\\udfff)")
    return value


Str = Annotated[str, AfterValidator(_encodable)]
Text = Annotated[str, Field(max_length=1 << 22), AfterValidator(_encodable)]
_FIRST = Field(fail_fast=True)  # a list's first bad item is its error: not one per item
Name = Annotated[str, Field(max_length=256), AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _GenerationBase(BaseModel):
    model_config = STRICT

    model: Str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1000, description="quantroute extension; 0 is off")
    n: int = Field(1, ge=1)
    stop: Str | Annotated[list[Annotated[Str, Field(min_length=1)]], _FIRST] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=300
    )
    ignore_eos: bool = Field(False, description="quantroute extension (as in vLLM)")
    # Routing extensions, checked by routing.requirement.parse_requirement:
    quality: Any = Field(None, description="a tier name or {max_kld, min_top1}")
    timeout: Any = Field(None, description="deadline in seconds")
    priority: int | None = Field(
        None,
        ge=-10,
        le=10,
        description="admission priority, added to the tenant's (at most its max_priority)",
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's extensions, with its meanings (engines/sampling.py):
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="0 is off")
    min_tokens: int = Field(0, ge=0, description="no end of sequence before this many tokens")
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _supported(self) -> _GenerationBase:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream: true")
        return self

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and not all(_TOKEN_ID.fullmatch(k) for k in value):
            raise ValueError("keys must be token ids (1 to 9 ASCII digits)")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def limit(self) -> int | None:
        """``max_tokens`` (or ``max_completion_tokens``), as the client gave it."""
        return self.max_tokens


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message. ``content`` is required, but for an assistant message that carries
    ``tool_calls`` instead; a ``tool`` message names the call it answers
    (``tool_call_id``)."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # before content: its check reads them
    tool_calls: Annotated[list[ToolCallIn], Field(min_length=1, max_length=128)] | None = None
    tool_call_id: (
        Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_encodable)] | None
    ) = None
    content: Text | Annotated[list[TextPart], Field(min_length=1, fail_fast=True)] | None = Field(
        None, validate_default=True
    )
    name: Annotated[str, Field(max_length=64), AfterValidator(_encodable)] | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _required(
        cls, value: str | list[TextPart] | None, info: ValidationInfo
    ) -> str | list[TextPart] | None:
        if value is None and not (
            info.data.get("role") == "assistant" and info.data.get("tool_calls")
        ):
            raise ValueError("content is required: a string or a list of text parts")
        return value

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry them")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise FieldError("tool_call_id", "a tool message needs one, and only a tool message")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (``api.tools.template_messages``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_GenerationBase):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldError("max_completion_tokens", "give it or max_tokens, not both")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "two functions have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise FieldError("tool_choice", "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", "names a function that is not in tools")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def limit(self) -> int | None:
        return self.completion_limit

    @property
    def active_tools(self) -> list[Tool] | None:
        """The tools the model is told of and may call (none with ``tool_choice`` none)."""
        return None if self.tool_choice == "none" else self.tools


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
_Lists = Annotated[list[Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]], _FIRST]


class CompletionRequest(_GenerationBase):
    """``prompt``: a string, a list of strings, a list of token ids, or a list of lists of
    token ids (ids are used as they are: no BOS is added)."""

    prompt: Text | Annotated[list[Text], _FIRST] | Annotated[list[TokenId], _FIRST] | _Lists
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.echo:
            raise FieldError("echo", "not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "must not be an empty list")
        return self

    @property
    def token_prompts(self) -> list[list[int]] | None:
        """The prompts as token ids, when the client gave ids."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], int):
            return [p]
        if isinstance(p, list) and isinstance(p[0], list):
            return list(p)
        return None

    @property
    def prompts(self) -> list[str]:
        """The prompts as text (for token-id prompts, empty strings: one per prompt)."""
        ids = self.token_prompts
        if ids is not None:
            return [""] * len(ids)
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)  # type: ignore[arg-type]


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: LimitSettings) -> None:
    """The bounds that come from settings; each failure names its field."""
    max_tokens = req.limit
    if max_tokens is not None and max_tokens > limits.max_tokens:
        given = getattr(req, "max_completion_tokens", None) is not None
        param = "max_completion_tokens" if given else "max_tokens"
        raise InvalidRequestError(f"{param} must be at most {limits.max_tokens}", param=param)
    if req.min_tokens > (max_tokens or limits.max_tokens):
        raise InvalidRequestError("min_tokens must be at most max_tokens", param="min_tokens")
    if req.n > limits.max_n:
        raise InvalidRequestError(f"n must be at most {limits.max_n}", param="n")
    stops = req.stops
    if len(stops) > limits.max_stop:
        raise InvalidRequestError(f"stop may have at most {limits.max_stop} entries", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise InvalidRequestError(
            f"each stop sequence must be at most {limits.max_stop_chars} characters", param="stop"
        )
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > limits.max_messages:
            raise InvalidRequestError(
                f"messages may have at most {limits.max_messages} entries", param="messages"
            )
        if sum(len(m.text) for m in req.messages) > limits.max_prompt_chars:
            raise InvalidRequestError(
                f"messages may hold at most {limits.max_prompt_chars} characters",
                param="messages",
            )
    else:
        prompts = req.prompts
        ids = req.token_prompts or []
        if any(len(p) > limits.max_prompt_chars for p in ids):
            raise InvalidRequestError(
                f"a prompt may hold at most {limits.max_prompt_chars} tokens", param="prompt"
            )
        if len(prompts) * req.n > limits.max_n:
            raise InvalidRequestError(
                f"len(prompt) * n must be at most {limits.max_n}", param="prompt"
            )
        if any(len(p) > limits.max_prompt_chars for p in prompts):
            raise InvalidRequestError(
                f"prompt may hold at most {limits.max_prompt_chars} characters", param="prompt"
            )


def check_vocabulary(req: ChatCompletionRequest | CompletionRequest, n_vocab: int) -> None:
    """Every token id the request names (``logit_bias`` keys, token prompts) lies in the
    model's vocabulary of ``n_vocab`` tokens: one outside it is a 400, never ignored."""
    for token, _ in req.bias:
        if token >= n_vocab:
            raise InvalidRequestError(
                f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                param="logit_bias",
            )
    if isinstance(req, CompletionRequest):
        for ids in req.token_prompts or ():
            bad = next((t for t in ids if t >= n_vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"prompt: token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                    param="prompt",
                )


def parse_generation_body(raw: bytes) -> ChatCompletionRequest | CompletionRequest:
    """A chat body (one with ``messages``) or a completion body, from raw bytes
    (:func:`parse_body`)."""
    data = _json(raw)
    if "messages" in data:
        return ChatCompletionRequest.model_validate(data)
    return CompletionRequest.model_validate(data)


def parse_body(raw: bytes, schema: type[_Model]) -> _Model:
    """``schema`` from a raw JSON body. A body that is missing, not JSON, not a JSON
    object, or nested deeper than :data:`MAX_JSON_DEPTH` is an
    :class:`InvalidRequestError` saying which; one that parses but breaks the schema
    raises pydantic's ``ValidationError`` for the caller to render."""
    return schema.model_validate(_json(raw))


def _json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequestError("The request body is missing.")
    if _too_deep(raw, MAX_JSON_DEPTH):
        raise InvalidRequestError(
            f"The request body is nested deeper than {MAX_JSON_DEPTH} levels."
        )
    try:
        data = json.loads(raw)
    except ValueError as exc:  # also bad UTF-8 and integers past Python's digit limit
        raise InvalidRequestError("The request body is not valid JSON.") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return data


_STEP = np.zeros(256, np.int8)  # a byte's step in depth: "{}" and "[]" are one level each
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def _too_deep(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` opens ``[`` / ``{`` (outside strings) more than ``limit`` deep at
    any point. Linear and in C whatever the body (no regular expression: one that read
    strings backtracked quadratically on an unterminated one, 4 s for 40 KB): escaped
    backslashes, then escaped quotes go; what lies between a quote and the next is a
    string; the depth is the running sum of the brackets outside them.

    >>> _too_deep(b'{"a": [1, {"b": "[[[[[["}]}', 3), _too_deep(b'[[[[]]]]', 3)
    (False, True)
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    inside = (np.cumsum(text == ord('"'), dtype=np.int32) & 1).astype(bool)  # opening quotes too
    steps = np.where(inside, 0, _STEP[text]).astype(np.int32)  # quotes step 0: inside or not
    return bool(np.cumsum(steps).max(initial=0) > limit)

"""Between the proto's messages and the HTTP API's: requests in, chunks and JSON views out.

A request becomes the HTTP body it stands for (the proto's fields have the body's names),
validated by the same schema (``api/schemas.py``), so every bound and every error names
the same field as over HTTP. A run's events become :class:`~quantroute.grpcapi.proto.pb`
``Chunk`` messages, one per batch of events (what was ready together goes together)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi.exceptions import RequestValidationError
from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct
from pydantic import BaseModel, ValidationError

from quantroute.api.errors import validation_error
from quantroute.api.run import Run
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.engines.base import EngineEvent, FinishEvent, TokenEvent
from quantroute.errors import InvalidRequestError
from quantroute.grpcapi.proto import pb

__all__ = [
    "Chunks",
    "branch_metadata",
    "chat_request",
    "completion_request",
    "struct",
]

_Model = TypeVar("_Model", bound=BaseModel)


def completion_request(msg: pb.GenerateRequest, timeout_s: float | None) -> CompletionRequest:
    """The ``POST /v1/completions`` body ``msg`` stands for, streamed with its usage;
    ``timeout_s``: the call's deadline, as the body's ``timeout``."""
    body = _body(msg, timeout_s)
    tokens = body.pop("prompt_tokens", None)
    if tokens is not None:
        if "prompt" in body:
            raise InvalidRequestError("give prompt or prompt_tokens, not both", param="prompt")
        body["prompt"] = tokens
    elif isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1:
        body["prompt"] = body["prompt"][0]  # one prompt: as the HTTP body's string
    return _validated(CompletionRequest, body)


def chat_request(msg: pb.ChatRequest, timeout_s: float | None) -> ChatCompletionRequest:
    """The ``POST /v1/chat/completions`` body ``msg`` stands for (as :func:`completion_request`)."""
    return _validated(ChatCompletionRequest, _body(msg, timeout_s))


def _body(msg: Message, timeout_s: float | None) -> dict[str, Any]:
    """``msg``'s set fields under their own names (which are the HTTP body's), streamed
    with the usage at the end. A field left unset is left out: the schema's default."""
    body: dict[str, Any] = {name: _value(name, value) for name, value in _fields(msg)}
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if timeout_s is not None:
        body["timeout"] = timeout_s
    return body


def _fields(msg: Message) -> list[tuple[str, Any]]:
    return [(field.name, value) for field, value in msg.ListFields()]


def _value(name: str, value: Any) -> Any:
    if name == "quality":
        return _quality(value)
    if name == "logit_bias":
        return {str(token): bias for token, bias in value.items()}  # the body's keys: strings
    if name == "messages":
        return [_message(message) for message in value]
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return value


def _message(message: pb.Message) -> dict[str, Any]:
    """A chat message: its content always (an empty string is one, as over HTTP), its
    name when set."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        out["name"] = message.name
    return out


def _quality(quality: pb.Quality) -> str | dict[str, float]:
    """A tier's name, or the bounds that are set (none: ``{}``, which the schema refuses
    as it refuses an empty object over HTTP)."""
    if quality.WhichOneof("requirement") == "tier":
        return quality.tier
    return dict(_fields(quality.bounds))


def _validated(schema: type[_Model], body: dict[str, Any]) -> _Model:
    try:
        return schema.model_validate(body)
    except ValidationError as exc:  # the HTTP 400's words and param, never the value
        raise validation_error(RequestValidationError(exc.errors())) from exc


def struct(data: Mapping[str, Any]) -> Struct:
    """A JSON object (a view's body) as a ``google.protobuf.Struct``."""
    out = Struct()
    out.update(data)
    return out


def branch_metadata(run: Run) -> tuple[tuple[str, str], ...]:
    """The initial metadata of a generation: the HTTP response's headers, the branch that
    serves first (``x-quantroute-branch``)."""
    branch = run.branch
    pairs = [
        ("x-quantroute-branch", branch.id),
        ("x-quantroute-route-reason", run.job.decision.reason),
        ("x-quantroute-artifact", branch.artifact.sha256[:16]),
        ("x-request-id", run.job.id),
    ]
    if branch.version is not None:
        pairs.append(("x-quantroute-version", branch.version))
    if branch.draft is not None and run.drafted:  # as over HTTP
        pairs.append(("x-quantroute-draft", branch.draft))
    return tuple((key, _ascii(value)) for key, value in pairs)


def _ascii(value: str) -> str:
    """Metadata values are printable ASCII: a name of other characters is percent-encoded."""
    return value if value.isascii() and value.isprintable() else quote(value, safe="")


class Chunks:
    """One run's events as ``Chunk`` messages: per batch, each choice's new text joined,
    its finish reason once it ends, and the usage on the chunk that ends the run."""

    def __init__(self, run: Run):
        self._run = run
        job = run.job
        self._id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.id
        self._model = run.branch.id
        self._created = int(time.time())
        self._completion = [0] * len(job.requests)  # per choice, from its FinishEvent

    def of(self, batch: Sequence[tuple[int, EngineEvent]]) -> pb.Chunk | None:
        """The chunk of ``batch``; ``None`` when it adds nothing (text held back for a
        possible stop sequence, a start event)."""
        texts: dict[int, list[str]] = {}  # in the order the choices came
        ends: dict[int, str] = {}
        for index, event in batch:
            if isinstance(event, TokenEvent):
                texts.setdefault(index, []).append(event.text)
            elif isinstance(event, FinishEvent):
                texts.setdefault(index, []).append(event.text)
                ends[index] = event.reason.value
                self._completion[index] = event.completion_tokens
        choices = [
            pb.Choice(index=index, text="".join(parts), finish_reason=ends.get(index, ""))
            for index, parts in texts.items()
            if index in ends or any(parts)
        ]
        usage = self._usage() if self._run.finished else None
        if not choices and usage is None:
            return None
        return pb.Chunk(
            id=self._id, model=self._model, created=self._created, choices=choices, usage=usage
        )

    def _usage(self) -> pb.Usage:
        run = self._run
        n = run.job.n  # the n choices of one prompt share it: each prompt counts once
        prompt = sum(run.prompt_tokens[::n])
        completion = sum(self._completion)
        return pb.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_tokens=sum(run.cached_tokens[::n]),
        )

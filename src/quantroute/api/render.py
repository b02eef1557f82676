"""Engine events to OpenAI's wire format: chat and text completions, chunks
for streams and whole objects otherwise."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # the C one, where built
from typing import Any

from quantroute.api.run import Run
from quantroute.api.tools import ToolCallStream, split_calls
from quantroute.engines.base import FinishEvent, TokenEvent

_HOLE = "\x00"  # stands for a chunk's text in its template: JSON writes it "\u0000"


def encode(obj: Any) -> bytes:
    """A JSON event payload (one line: JSON escapes newlines in strings)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    finish_reason: str | None = None
    completion_tokens: int = 0
    tools: ToolCallStream | None = None  # a streamed chat reply's tool calls


class ResponseRenderer:
    """Builds the JSON objects for one run, stream or whole."""

    def __init__(self, run: Run):
        self.run = run
        self.chat = run.job.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + run.job.id
        self.created = int(time.time())
        self.model = run.branch.id
        self.choices = [_Choice() for _ in run.job.requests]
        self.tools = self.chat and run.job.tools  # read tool calls out of the replies
        # the bytes around a plain token chunk's text, per choice (see ``tokens_data``)
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    # -- shared ---------------------------------------------------------------

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"quantroute-{self.run.branch.artifact.sha256[:12]}",
        }

    def usage(self) -> dict[str, Any]:
        # The n choices of one prompt share it: count each prompt once.
        prompt = sum(self.run.prompt_tokens[:: self.run.job.n])
        cached = sum(self.run.cached_tokens[:: self.run.job.n])
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprob_entry(self, choice: _Choice, event: TokenEvent) -> dict[str, Any] | None:
        if event.logprob is None:
            return None
        piece = event.piece or ""
        if self.chat:
            return {
                "token": piece,
                "logprob": event.logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for _, t, lp in event.top_logprobs
                ],
            }
        # the legacy API's top always holds the sampled token as well (so up to logprobs + 1
        # entries, and the sampled one alone for logprobs: 0), as OpenAI's and vLLM's do
        top = {t: lp for _, t, lp in event.top_logprobs}
        top.setdefault(piece, event.logprob)
        entry = {
            "token": piece,
            "logprob": event.logprob,
            "offset": choice.offset,
            "top": top,
        }
        choice.offset += len(event.text)
        return entry

    @staticmethod
    def _completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries],
            "text_offset": [e["offset"] for e in entries],
        }

    def _record(self, index: int, event: TokenEvent | FinishEvent) -> tuple[str, Any]:
        """Fold one event into choice ``index``; return its text and logprob entry."""
        choice = self.choices[index]
        if isinstance(event, FinishEvent):
            choice.finish_reason = event.reason.value
            choice.completion_tokens = event.completion_tokens
            choice.text.append(event.text)
            return event.text, None
        choice.completion_tokens += 1
        entry = self._logprob_entry(choice, event)
        choice.text.append(event.text)
        if entry is not None:
            choice.logprobs.append(entry)
        return event.text, entry

    # -- streams --------------------------------------------------------------

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open every choice with its role."""
        if not self.chat:
            return []
        return [
            self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            for i in range(len(self.choices))
        ]

    def chunk(self, index: int, event: TokenEvent | FinishEvent) -> dict[str, Any] | None:
        if isinstance(event, FinishEvent):
            text, _ = self._record(index, event)
            return self._text_chunk(index, text, [], event.reason.value)
        return self.tokens_chunk(index, [event])

    def tokens_chunk(self, index: int, events: list[TokenEvent]) -> dict[str, Any] | None:
        """One chunk for consecutive tokens of choice ``index`` (several when the reader
        lagged): their text joined, their logprob entries in order."""
        texts: list[str] = []
        entries: list[dict[str, Any]] = []
        for event in events:
            text, entry = self._record(index, event)
            texts.append(text)
            if entry is not None:
                entries.append(entry)
        return self._text_chunk(index, "".join(texts), entries, None)

    def tokens_data(self, index: int, events: list[TokenEvent]) -> bytes | None:
        """:meth:`tokens_chunk`, encoded: the same bytes as ``encode(tokens_chunk(...))``.

        The hot path of a stream. A plain chunk (text only: no tool calls read out, no
        logprobs) is its choice's template around the JSON of its text, so a token costs
        one string encoding instead of building and encoding a dict tree."""
        if self.tools or any(e.logprob is not None for e in events):
            body = self.tokens_chunk(index, events)
            return None if body is None else encode(body)
        choice = self.choices[index]
        choice.completion_tokens += len(events)
        if len(events) == 1:
            text = events[0].text
            choice.text.append(text)
        else:
            text = "".join(e.text for e in events)
            choice.text.extend(e.text for e in events)
        if not text:
            return None  # held back (a possible stop sequence, or a partial character)
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index)
        head, tail = template
        return head + encode_basestring(text).encode() + tail

    def _template(self, index: int) -> tuple[bytes, bytes]:
        delta: Any = {"content": _HOLE} if self.chat else _HOLE
        data = encode(self._chunk(index, delta, None, None))
        head, _, tail = data.rpartition(encode(_HOLE))  # the text is the last string
        return head, tail

    def _text_chunk(
        self, index: int, text: str, entries: list[dict[str, Any]], finish: str | None
    ) -> dict[str, Any] | None:
        if self.tools:
            return self._tool_chunk(index, text, entries, finish)
        if not text and not entries and finish is None:
            return None  # held back (a possible stop sequence, or a partial character)
        if self.chat:
            logprobs = {"content": entries} if entries else None
            return self._chunk(
                index, {"content": text} if text or not finish else {}, logprobs, finish
            )
        return self._chunk(
            index, text, self._completion_logprobs(entries) if entries else None, finish
        )

    def _tool_chunk(
        self, index: int, text: str, entries: list[dict[str, Any]], finish: str | None
    ) -> dict[str, Any] | None:
        """A chat chunk with tools: content outside ``<tool_call>`` blocks, and each call
        as one ``delta.tool_calls`` entry once its block is complete."""
        choice = self.choices[index]
        if choice.tools is None:
            choice.tools = ToolCallStream(self.run.job.parallel_tool_calls)
        stream = choice.tools
        before = len(stream.calls)
        content, calls = stream.feed(text)
        if finish is not None:
            content += stream.flush()
            finish = _finish_with_calls(finish, bool(stream.calls))
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [c.to_openai(before + k) for k, c in enumerate(calls)]
        if not delta and not entries and finish is None:
            return None
        logprobs = {"content": entries} if entries else None
        return self._chunk(index, delta, logprobs, finish)

    def _chunk(self, index: int, delta: Any, logprobs: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            body = self._head("text_completion") | {"choices": [choice]}
        if self.run.job.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": self.usage()}

    # -- whole responses ------------------------------------------------------

    def add(self, index: int, event: TokenEvent | FinishEvent) -> None:
        self._record(index, event)

    def whole(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                logprobs = {"content": c.logprobs} if self.run.job.logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if self.tools:
                    content, calls = split_calls(text, parallel=self.run.job.parallel_tool_calls)
                    if calls:
                        message["content"] = content.strip() or None
                        message["tool_calls"] = [call.to_openai() for call in calls]
                        finish = _finish_with_calls(finish, True)
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                )
            else:
                logprobs = self._completion_logprobs(c.logprobs) if self.run.job.logprobs else None
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if self.chat else "text_completion"
        return self._head(obj) | {"choices": choices, "usage": self.usage()}


def _finish_with_calls(finish: str | None, calls: bool) -> str | None:
    """A reply that made tool calls ends ``tool_calls`` (unless the client left, or its
    deadline cut it)."""
    return "tool_calls" if calls and finish in ("stop", "length") else finish

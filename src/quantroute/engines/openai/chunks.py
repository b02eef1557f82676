"""What an upstream's streamed chunks say: the text and logprobs they add, how the
generation finished, how many tokens it counted, and what an error body says. Each
reads JSON the server chose, so each checks every type it reads and never trusts a
shape: a field of the wrong type is as good as absent.

>>> tokens_of({"choices": [{"delta": {"content": "Hi"}}]}, chat=True)
[TokenEvent(text='Hi', token_id=-1, logprob=None, piece=None, top_logprobs=())]
>>> finish_of({"choices": [{"finish_reason": "length"}]})
<FinishReason.LENGTH: 'length'>
"""

from __future__ import annotations

import json
import math
from typing import Any

from quantroute.engines.base import FinishReason, TokenEvent

__all__ = ["count", "error_of", "finish_of", "tokens_of"]

MESSAGE_CHARS = 300  # of an upstream's error message, passed on
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "content_filter": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
}


def count(value: object, default: int) -> int:
    return value if isinstance(value, int) and value >= 0 else default


def error_of(raw: bytes) -> tuple[str, str | None]:
    """An upstream error body's message (cut short) and code."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return "no reason given", None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = error.get("message")
        code = error.get("code")
    else:
        message, code = (body.get("message") if isinstance(body, dict) else None), None
    text = message[:MESSAGE_CHARS] if isinstance(message, str) else "no reason given"
    return text, code if isinstance(code, str) and len(code) <= 64 else None


def tokens_of(event: dict[str, Any], chat: bool) -> list[TokenEvent]:
    """The text an upstream chunk adds, as token events (one per logprobs entry where it
    sent logprobs, else one for its text)."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return []
    choice = choices[0]
    if not isinstance(choice, dict):
        return []
    if chat:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    if not isinstance(text, str) or not text:
        return []
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = _logprob_entries(logprobs)
        if len(entries) == 1:
            piece, token_id, lp, top = entries[0]
            return [TokenEvent(text, token_id, lp, piece, top)]
        if entries and "".join(e[0] for e in entries) == text:  # one event per token
            return [TokenEvent(p, i, lp, p, top) for p, i, lp, top in entries]
    return [TokenEvent(text, -1)]


_Entry = tuple[str, int, float | None, tuple[tuple[int, str, float], ...]]


def _logprob_entries(logprobs: dict[str, Any]) -> list[_Entry]:
    """A chunk's logprobs: chat's ``content`` list (which llama-server also sends for
    completions, with token ids), else the legacy completions arrays."""
    out: list[_Entry] = []
    content = logprobs.get("content")
    if isinstance(content, list):
        for entry in content:
            if not isinstance(entry, dict):
                continue
            top = tuple(
                (_id(t), str(t.get("token", "")), _float(t.get("logprob")))
                for t in _list(entry.get("top_logprobs"))
                if isinstance(t, dict)
            )
            lp = entry.get("logprob")
            piece = str(entry.get("token", ""))
            out.append((piece, _id(entry), None if lp is None else _float(lp), top))
        return out
    tokens = _list(logprobs.get("tokens"))
    lps = _list(logprobs.get("token_logprobs"))
    tops = _list(logprobs.get("top_logprobs"))
    for i, token in enumerate(tokens):
        lp = lps[i] if i < len(lps) else None
        top_map = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        top = tuple((-1, str(k), _float(v)) for k, v in top_map.items())
        out.append((str(token), -1, None if lp is None else _float(lp), top))
    return out


def _list(value: object) -> list[Any]:
    """``value`` when it is a list; anything else is as good as absent."""
    return value if isinstance(value, list) else []


def _id(entry: dict[str, Any]) -> int:
    value = entry.get("id")
    return value if isinstance(value, int) and value >= 0 else -1


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else -math.inf


def finish_of(event: dict[str, Any]) -> FinishReason | None:
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    reason = choices[0].get("finish_reason")
    if not isinstance(reason, str):
        return None
    return _FINISH.get(reason, FinishReason.STOP)

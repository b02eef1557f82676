"""Server-sent events for a run: OpenAI chunks, keep-alives, an error event.

A run's events are produced once (:func:`payloads`, into a
``resilience.resume.Stream``) and written to each client that follows the
stream (:func:`sse_stream`): the one that started it and any that resume it.
Every event carries ``id: <job id>/<seq>``, the first a ``retry:`` hint; a
client that reconnects with that id as ``Last-Event-ID`` gets the events
after it.

A failure after the first chunk ends the stream with ``data: {"error": ...}``
and no ``[DONE]``, so a client can tell a cut stream from a finished one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from quantroute.api.jobs import Run, Tick
from quantroute.api.render import ResponseRenderer
from quantroute.engines.base import StartEvent
from quantroute.errors import QuantrouteError
from quantroute.resilience.resume import Stream

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
DONE = b"[DONE]"
RETRY_MS = 1000  # how long a client (EventSource) waits before reconnecting


def encode(obj: Any) -> bytes:
    """A JSON event payload (one line: JSON escapes newlines in strings)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def payloads(run: Run) -> AsyncIterator[bytes]:
    """The data of each event of a streamed run: its chunks, then ``[DONE]`` or an error."""
    renderer = ResponseRenderer(run)
    try:
        for chunk in renderer.first_chunks():
            yield encode(chunk)
        async for item in run.events():
            if isinstance(item, Tick):
                continue
            index, event = item
            if isinstance(event, StartEvent):
                continue
            body = renderer.chunk(index, event)
            if body is not None:
                yield encode(body)
        if run.job.include_usage:
            yield encode(renderer.usage_chunk())
        yield DONE
    except QuantrouteError as exc:
        log.warning("stream %s on %s ended early: %s", run.job.id, run.branch.id, exc.message)
        yield encode(exc.to_openai())
    except Exception:
        log.exception("stream %s on %s failed", run.job.id, run.branch.id)
        yield encode(QuantrouteError("internal error while streaming").to_openai())


def frame(key: str, seq: int, data: bytes, *, retry: bool = False) -> bytes:
    """One SSE event: ``[retry: MS\\n]id: KEY/SEQ\\ndata: DATA\\n\\n``."""
    head = b"retry: %d\n" % RETRY_MS if retry else b""
    return head + b"id: " + key.encode() + b"/%d\ndata: " % seq + data + b"\n\n"


async def sse_stream(stream: Stream, after: int | None, keepalive_s: float) -> AsyncIterator[bytes]:
    """The wire bytes of ``stream`` from the event after ``after`` (``None``: all) on."""
    first = True
    try:
        async for item in stream.follow(after, keepalive_s):
            if item is None:
                yield KEEPALIVE
                continue
            seq, data = item
            yield frame(stream.key, seq, data, retry=first)
            first = False
    except QuantrouteError as exc:  # this client fell behind what the stream keeps
        yield b"data: " + encode(exc.to_openai()) + b"\n\n"

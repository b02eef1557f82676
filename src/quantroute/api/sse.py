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

import logging
from collections.abc import AsyncIterator, Iterator

from quantroute.api.jobs import Run, Tick
from quantroute.api.render import ResponseRenderer, encode
from quantroute.engines.base import EngineEvent, FinishEvent, TokenEvent
from quantroute.errors import QuantrouteError
from quantroute.resilience.resume import Stream

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
DONE = b"[DONE]"
RETRY_MS = 1000  # how long a client (EventSource) waits before reconnecting


async def payloads(run: Run) -> AsyncIterator[bytes]:
    """The data of each event of a streamed run: its chunks, then ``[DONE]`` or an error."""
    renderer = ResponseRenderer(run)
    try:
        for chunk in renderer.first_chunks():
            yield encode(chunk)
        async for batch in run.batches():
            if isinstance(batch, Tick):
                continue
            for data in _chunks(renderer, batch):
                yield data
        if run.job.include_usage:
            yield encode(renderer.usage_chunk())
        yield DONE
    except QuantrouteError as exc:
        log.warning("stream %s on %s ended early: %s", run.job.id, run.branch.id, exc.message)
        yield encode(exc.to_openai())
    except Exception:
        log.exception("stream %s on %s failed", run.job.id, run.branch.id)
        yield encode(QuantrouteError("internal error while streaming").to_openai())


def _chunks(renderer: ResponseRenderer, batch: list[tuple[int, EngineEvent]]) -> Iterator[bytes]:
    """The chunks of a batch of events, encoded: consecutive tokens of one choice make one
    chunk."""
    tokens: list[TokenEvent] = []
    at = -1
    for index, event in batch:
        if tokens and (index != at or not isinstance(event, TokenEvent)):
            data = renderer.tokens_data(at, tokens)
            tokens = []
            if data is not None:
                yield data
        if isinstance(event, TokenEvent):
            tokens.append(event)
            at = index
        elif isinstance(event, FinishEvent):
            body = renderer.chunk(index, event)
            if body is not None:
                yield encode(body)
    if tokens:
        data = renderer.tokens_data(at, tokens)
        if data is not None:
            yield data


def frame(key: str, seq: int, data: bytes, *, retry: bool = False) -> bytes:
    """One SSE event: ``[retry: MS\\n]id: KEY/SEQ\\ndata: DATA\\n\\n``."""
    head = b"retry: %d\n" % RETRY_MS if retry else b""
    return head + b"id: " + key.encode() + b"/%d\ndata: " % seq + data + b"\n\n"


async def sse_stream(stream: Stream, after: int | None, keepalive_s: float) -> AsyncIterator[bytes]:
    """The wire bytes of ``stream`` from the event after ``after`` (``None``: all) on: one
    write per batch the stream hands out, each event framed as :func:`frame` does."""
    first = True
    key = stream.key.encode().replace(b"%", b"%%")
    pattern = b"id: " + key + b"/%d\ndata: %b\n\n"  # a frame, but for its seq and data
    try:
        async for batch in stream.follow_batches(after, keepalive_s):
            if batch is None:
                yield KEEPALIVE
                continue
            if first:
                seq, data = batch[0]
                first = False
                head = frame(stream.key, seq, data, retry=True)
                yield head + b"".join([pattern % event for event in batch[1:]])
            elif len(batch) == 1:
                yield pattern % batch[0]
            else:
                yield b"".join([pattern % event for event in batch])
    except QuantrouteError as exc:  # this client fell behind what the stream keeps
        yield b"data: " + encode(exc.to_openai()) + b"\n\n"

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

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from quantroute.api.direct import EXTENSION, DirectBody
from quantroute.api.render import ResponseRenderer, encode
from quantroute.api.run import Run, Tick
from quantroute.engines.base import EngineEvent, FinishEvent, TokenEvent
from quantroute.errors import QuantrouteError
from quantroute.resilience.resume import Stream

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
DONE = b"[DONE]"
RETRY_MS = 1000  # how long a client (EventSource) waits before reconnecting


def payloads(
    run: Run, renderer: ResponseRenderer | None = None
) -> tuple[list[bytes], AsyncIterator[list[bytes]]]:
    """The data of each event of a streamed run: those ready now (the opening chunks and
    the first token, which the service read before committing), and the rest as they
    come: its chunks, then ``[DONE]`` or an error."""
    renderer = renderer or ResponseRenderer(run)
    try:
        first = [encode(chunk) for chunk in renderer.first_chunks()]
        first.extend(_chunks(renderer, run.take_pending()))
    except Exception as exc:
        return [], _failed(run, exc)
    return first, _rest(run, renderer)


async def _rest(run: Run, renderer: ResponseRenderer) -> AsyncIterator[list[bytes]]:
    """The chunks of each batch of events together; the last batch's with the usage and
    ``[DONE]``, so that a stream's end is one write (``Stream.extend``)."""
    last: list[bytes] = []
    try:
        async for batch in run.batches():
            if isinstance(batch, Tick):
                continue
            chunks = list(_chunks(renderer, batch))
            if run.finished:  # its last events: the batches end here
                last += chunks
            elif chunks:
                yield chunks
        if run.job.include_usage:
            last.append(encode(renderer.usage_chunk()))
        last.append(DONE)
        yield last
    except Exception as exc:
        yield [*last, _error(run, exc)]


def write_inline(run: Run, renderer: ResponseRenderer, stream: Stream) -> None:
    """Let ``run`` hand its plain tokens to ``stream`` as they come, rendered in the
    engine's task (``Run.inline``) while the stream has room for them: the producer's
    task wakes only for the rest (an end, an error, a token with logprobs, a full
    window). ``renderer`` is the one :func:`payloads` was given for ``run``."""

    def take(batch: list[tuple[int, EngineEvent]]) -> bool:
        if not stream.room_for(len(batch)):  # a chunk per event at most
            return False
        stream.extend(list(_chunks(renderer, batch)))
        return True

    run.inline = take


async def _failed(run: Run, exc: Exception) -> AsyncIterator[list[bytes]]:
    yield [_error(run, exc)]


def _error(run: Run, exc: Exception) -> bytes:
    """The last event of a stream that failed with ``exc``: its error, or an internal one."""
    if isinstance(exc, QuantrouteError):
        log.warning("stream %s on %s ended early: %s", run.job.id, run.branch.id, exc.message)
        return encode(exc.to_openai())
    log.error("stream %s on %s failed", run.job.id, run.branch.id, exc_info=exc)
    return encode(QuantrouteError("internal error while streaming").to_openai())


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


async def sse_stream(
    stream: Stream,
    after: int | None,
    keepalive_s: float,
    until: asyncio.Future[Any] | None = None,
    direct: DirectBody | None = None,
) -> AsyncGenerator[bytes, None]:
    """The wire bytes of ``stream`` from the event after ``after`` (``None``: all) on: one
    write per batch the stream hands out, each event framed as :func:`frame` does. Ends
    when ``until`` is done (the client left). With ``direct``, the events that come while
    the client keeps up are written through it as they are appended, framed the same,
    and never pass here (``api/direct.py``)."""
    first = True
    key = stream.key.encode().replace(b"%", b"%%")
    pattern = b"id: " + key + b"/%d\ndata: %b\n\n"  # a frame, but for its seq and data
    write = None
    if direct is not None:
        body = direct

        def write(seq: int, datas: Sequence[bytes]) -> bool:
            if len(datas) == 1:
                return body.write(pattern % (seq, datas[0]))
            return body.write(b"".join([pattern % (seq + i, d) for i, d in enumerate(datas)]))

    try:
        async for batch in stream.follow_batches(after, keepalive_s, until=until, direct=write):
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


class EventStreamResponse(Response):
    """A stream's SSE response, written by the request's own task.

    Starlette's ``StreamingResponse`` writes from a second task in an anyio task group
    and cancels it on a disconnect; this one writes in place, and a plain task waits for
    the disconnect (which an ASGI 2.3 server tells only through ``receive``) and ends
    the stream's follow (:meth:`Stream.follow_batches`, ``until``), as a watcher that
    left: the same behaviour for less work per request."""

    media_type = "text/event-stream"

    def __init__(
        self, stream: Stream, after: int | None, keepalive_s: float, headers: Mapping[str, str]
    ):
        self.stream = stream
        self.after = after
        self.keepalive_s = keepalive_s
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.get_running_loop().create_task(_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            direct = (scope.get("extensions") or {}).get(EXTENSION)
            body = sse_stream(self.stream, self.after, self.keepalive_s, gone, direct)
            async with contextlib.aclosing(body) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (its request's body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass

"""Server-sent events for a run: OpenAI chunks, keep-alives, an error event.

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

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def encode(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_events(run: Run, keepalive_s: float) -> AsyncIterator[bytes]:
    renderer = ResponseRenderer(run)
    try:
        for chunk in renderer.first_chunks():
            yield encode(chunk)
        async for item in run.events(keepalive_s):
            if isinstance(item, Tick):
                yield KEEPALIVE
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

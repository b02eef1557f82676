"""A request's output grammar, worked out off the event loop and within bounds.

What a schema, a ``pattern`` or a forced tool call costs to check and convert into
GBNF is the client's to choose (a 1 MiB ``pattern`` class held the event loop 5.3 s,
every stream with it). So :class:`Grammars` works it out:

- after the tenant's limits (``Service.prepare``): a tenant over its limits gets its
  429 before any of this runs, and a refused schema still counts in its minute;
- in a thread (the loop's default executor), at most :data:`AT_ONCE` at a time (a slot
  is held until its thread is done, even past a request that gave up on it); a request
  that waits ``limits.compile_timeout_s`` for a slot is a 503 to retry;
- within ``limits.compile_timeout_s`` of that thread's CPU time: the checks look at the
  clock themselves (``engines.pattern.cpu_budget``; a Python thread cannot be stopped
  from outside) and refuse the schema, a 400 naming its field; past twice that, plus a
  second, of wall time the request is answered that 400 anyway and the thread finishes
  on its own (the converter, llama.cpp's, cannot look at the clock);
- within bounds on bytes checked before the work they bound: the schemas' JSON text
  (1 MiB), a pattern's length (8,192 characters), the subschemas (2,000);
- once per schema: what it made, grammar or refusal, is remembered by its exact JSON
  text (``engines.grammar``'s memo, 16 MiB), so the same schema again is a lookup.

A request with no ``response_format`` schema and no forced tool call has no grammar,
and ``json_object`` has one fixed grammar: both are known from the parsed body at once,
with no thread and no slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from quantroute.api.jobs import request_grammar
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import JsonObjectFormat, forces_tools, needs_grammar
from quantroute.errors import InvalidRequestError, ServiceUnavailableError
from quantroute.shaping.grammar import json_object_grammar
from quantroute.shaping.pattern import cpu_budget

__all__ = ["AT_ONCE", "Grammars"]

log = logging.getLogger(__name__)

AT_ONCE = 2  # grammars compiled at once: the rest wait (a slot each is all they get)
_WALL_SLACK_S = 1.0


class Grammars:
    """Works out requests' grammars (:func:`quantroute.api.jobs.request_grammar`) in
    threads, each within ``timeout_s`` of CPU time; see the module's docstring."""

    def __init__(self, timeout_s: float, at_once: int = AT_ONCE):
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(at_once)

    async def of(self, req: ChatCompletionRequest | CompletionRequest) -> str | None:
        """``req``'s grammar, or ``None``; a 400 naming the field for a schema refused or
        too costly, a 503 when others held every slot for the whole timeout."""
        tools = req.tools if isinstance(req, ChatCompletionRequest) else None
        choice = req.tool_choice if isinstance(req, ChatCompletionRequest) else None
        if not needs_grammar(req.response_format, tools, choice):
            return None  # the fast path: no thread, no slot
        forced = forces_tools(tools, choice)
        if not forced and isinstance(req.response_format, JsonObjectFormat):
            return json_object_grammar()  # one fixed grammar: nothing the client chose
        param = "tools" if forced else "response_format"
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise ServiceUnavailableError(
                "the server is busy compiling other requests' grammars", retry_after_s=1.0
            ) from None
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, _bounded, req, self._timeout_s)
        work.add_done_callback(self._done)
        try:  # shielded: a request that stops waiting leaves the slot to the thread
            return await asyncio.wait_for(asyncio.shield(work), 2 * self._timeout_s + _WALL_SLACK_S)
        except TimeoutError:
            log.warning("a grammar ran past its wall-time bound; its thread finishes alone")
            raise InvalidRequestError(
                f"the {param} schema takes longer to compile than this server allows",
                param=param,
            ) from None

    def _done(self, work: asyncio.Future[Any]) -> None:
        self._slots.release()
        if not work.cancelled():
            work.exception()  # seen: one nobody waits for any more is no "never retrieved"


def _bounded(req: ChatCompletionRequest | CompletionRequest, timeout_s: float) -> str | None:
    """In a thread: the grammar, its checks within ``timeout_s`` of this thread's CPU."""
    with cpu_budget(timeout_s):
        return request_grammar(req)

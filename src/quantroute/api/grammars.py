"""A request's output grammar, worked out off the event loop and within bounds.

What a schema, a ``pattern`` or a forced tool call costs to check and convert into
GBNF is the client's to choose (a 1 MiB ``pattern`` class held the event loop 5.3 s,
every stream with it). So :class:`Grammars` works it out:

- after the tenant's limits (``Service.prepare``): a tenant over its limits gets its
  429 before any of this runs, and a refused schema still counts in its minute;
- in a thread (the loop's default executor), at most :data:`AT_ONCE` at a time (a slot
  is held until its thread is done, even past a request that gave up on it); a request
  that waits ``limits.compile_timeout_s`` for a slot is a 503 to retry;
- at most :data:`PER_TENANT` of those slots held by one tenant (a client key) at a time,
  so a tenant that keeps sending costly schemas within its rate limit leaves the other
  slots to the other tenants; one that waits the timeout for its own turn is a 429 to
  retry. Open mode (no keys) has one tenant, every client: no per-tenant bound;
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
from dataclasses import dataclass
from typing import Any

from quantroute.api.jobs import request_grammar
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import JsonObjectFormat, forces_tools, needs_grammar
from quantroute.errors import InvalidRequestError, RateLimitError, ServiceUnavailableError
from quantroute.shaping.grammar import json_object_grammar
from quantroute.shaping.pattern import cpu_budget

__all__ = ["AT_ONCE", "PER_TENANT", "Grammars"]

log = logging.getLogger(__name__)

AT_ONCE = 2  # grammars compiled at once: the rest wait (a slot each is all they get)
PER_TENANT = 1  # of those, held by one tenant at once
_WALL_SLACK_S = 1.0


@dataclass
class _Own:
    """A tenant's own slots, and how many of its requests hold or wait for one."""

    slots: asyncio.Semaphore
    users: int = 0


class Grammars:
    """Works out requests' grammars (:func:`quantroute.api.jobs.request_grammar`) in
    threads, each within ``timeout_s`` of CPU time; see the module's docstring."""

    def __init__(self, timeout_s: float, at_once: int = AT_ONCE, per_tenant: int = PER_TENANT):
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(at_once)
        self._per_tenant = per_tenant
        self._own: dict[str, _Own] = {}  # per tenant, while its requests hold or wait

    async def of(
        self, req: ChatCompletionRequest | CompletionRequest, tenant: str | None = None
    ) -> str | None:
        """``req``'s grammar, or ``None``; a 400 naming the field for a schema refused or
        too costly, a 429 when ``tenant``'s own slots stayed busy for the whole timeout,
        a 503 when others held every slot for it (``tenant`` ``None``: no bound of its
        own, open mode)."""
        tools = req.tools if isinstance(req, ChatCompletionRequest) else None
        choice = req.tool_choice if isinstance(req, ChatCompletionRequest) else None
        if not needs_grammar(req.response_format, tools, choice):
            return None  # the fast path: no thread, no slot
        forced = forces_tools(tools, choice)
        if not forced and isinstance(req.response_format, JsonObjectFormat):
            return json_object_grammar()  # one fixed grammar: nothing the client chose
        param = "tools" if forced else "response_format"
        own = await self._take(tenant)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(None, _bounded, req, self._timeout_s)
        work.add_done_callback(lambda done: self._done(done, tenant, own))
        try:  # shielded: a request that stops waiting leaves the slot to the thread
            return await asyncio.wait_for(asyncio.shield(work), 2 * self._timeout_s + _WALL_SLACK_S)
        except TimeoutError:
            log.warning("a grammar ran past its wall-time bound; its thread finishes alone")
            raise InvalidRequestError(
                f"the {param} schema takes longer to compile than this server allows",
                param=param,
            ) from None

    async def _take(self, tenant: str | None) -> _Own | None:
        """A slot, ``tenant``'s own first, both within the timeout; what :meth:`_done`
        gives back (``None`` without a tenant)."""
        own = None
        if tenant is not None:
            own = self._own.get(tenant)
            if own is None:
                own = self._own[tenant] = _Own(asyncio.Semaphore(self._per_tenant))
            own.users += 1
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        try:
            if own is not None:
                try:
                    async with asyncio.timeout_at(deadline):
                        await own.slots.acquire()
                except TimeoutError:
                    raise RateLimitError(
                        "this key is compiling as many grammars as it may at once",
                        retry_after_s=1.0,
                    ) from None
            try:
                async with asyncio.timeout_at(deadline):
                    await self._slots.acquire()
            except BaseException:
                if own is not None:
                    own.slots.release()
                raise
        except BaseException as exc:
            self._leave(tenant, own)
            if isinstance(exc, TimeoutError):
                raise ServiceUnavailableError(
                    "the server is busy compiling other requests' grammars", retry_after_s=1.0
                ) from None
            raise
        return own

    def _leave(self, tenant: str | None, own: _Own | None) -> None:
        """One user fewer of ``tenant``'s slots: the map holds only tenants whose requests
        hold or wait for one."""
        if tenant is not None and own is not None:
            own.users -= 1
            if own.users == 0:
                del self._own[tenant]

    def _done(self, work: asyncio.Future[Any], tenant: str | None, own: _Own | None) -> None:
        self._slots.release()
        if own is not None:
            own.slots.release()
            self._leave(tenant, own)
        if not work.cancelled():
            work.exception()  # seen: one nobody waits for any more is no "never retrieved"


def _bounded(req: ChatCompletionRequest | CompletionRequest, timeout_s: float) -> str | None:
    """In a thread: the grammar, its checks within ``timeout_s`` of this thread's CPU."""
    with cpu_budget(timeout_s):
        return request_grammar(req)

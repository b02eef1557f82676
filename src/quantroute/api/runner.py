"""Running a prepared job: the first branch of its decision that gets to its first token.

:class:`Runner` is the service's engine-facing half. The commit point is each
choice's first token: until then a failure of the branch moves the request to
the decision's next branch, within the retry budget, and counts against the
branch's circuit breaker; afterwards an error ends the stream. Every way out
gives the job's admission ticket back and counts the tenant's tokens.

A job routed before a reload's swap may reach a branch after it: a branch the
new table serves with another worker is run on that worker (its successor)
when that is known to be as faithful as the file the job was routed to; one
the table no longer has, or whose new file is not, is tried on its old worker
while it drains, and
its failure (the worker stopped) moves on like any other, counted by no
circuit breaker.

The composition root hands a :class:`Runner` what it uses: the route table's reference,
the circuit breakers, the retry budget, the tenants' limits, two timings and the
callback told of each finished request; a test builds one from plain data.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from quantroute.api.jobs import Job
from quantroute.api.run import Run, close_all
from quantroute.engines.base import EngineEvent, FinishEvent, StartEvent, TokenEvent
from quantroute.errors import (
    ContextLengthExceededError,
    DeviceOutOfMemoryError,
    EngineError,
    ServiceUnavailableError,
    UnsupportedByBranchError,
)
from quantroute.resilience import Breakers, RetryBudget
from quantroute.resilience.tenants import Limits
from quantroute.routing.table import Branch, RouteTable, RouteTableRef

log = logging.getLogger(__name__)


class Runner:
    """Runs jobs on ``routes``' branches. ``first_token_timeout_s``: the longest a branch
    may take to a first token before the job moves on (``resilience``);
    ``retry_after_s``: the Retry-After of its 503s (``routing``); ``finished(run,
    tokens)``: told when a run's first choice finished (``Run``'s ``on_finished``)."""

    def __init__(
        self,
        routes: RouteTableRef,
        breakers: Breakers,
        budget: RetryBudget,
        limits: Limits,
        *,
        first_token_timeout_s: float,
        retry_after_s: float,
        finished: Callable[[Run, list[int]], None] | None = None,
    ):
        self._routes = routes
        self._breakers = breakers
        self._budget = budget
        self._limits = limits
        self._first_token_timeout_s = first_token_timeout_s
        self._retry_after_s = retry_after_s
        self._finished = finished

    def abandon(self, job: Job, tokens: int = 0) -> None:
        """The job is over: give back its admission ticket and count its tokens."""
        if job.ticket is not None:
            job.ticket.release()
        self._limits.finished(job.tenant, tokens)

    async def start(self, job: Job) -> Run:
        """Open every choice on the first branch that takes them all.

        The commit point is each choice's first token: until then any failure of the
        branch (an error, its worker's death, an out-of-memory, no first token in
        ``resilience.first_token_timeout_s`` or by the deadline) moves the request to
        the decision's next branch, within the retry budget. A branch whose breaker
        is open is passed over (that is not its failure). Afterwards an error ends the
        stream (an error event, no ``[DONE]``)."""
        budget, breakers, routes = self._budget, self._breakers, self._routes
        budget.start()
        retries = 0
        last: EngineError | None = None
        tried = 0
        retired = False  # a branch that failed was one a reload had replaced
        unsupported: UnsupportedByBranchError | None = None  # a branch that cannot do it
        try:
            for routed in job.branches:
                branch = _successor(routes.current, routed, pinned=job.decision.pinned)
                if not breakers.acquire(branch.id):
                    job.trace.skipped(branch, "breaker_open")
                    continue  # open: its own rejection, never counted as a failure
                if tried and not budget.try_retry():
                    breakers.release(branch.id)
                    job.trace.skipped(branch, "retry_budget")
                    log.warning("job %s: retry budget spent; not trying %s", job.id, branch.id)
                    break
                retries += 1 if tried else 0
                tried += 1
                try:
                    job.trace.attempt(branch)
                    run = await self._open(job, branch, retries)
                except ContextLengthExceededError as exc:
                    breakers.release(branch.id)  # the request's fault, not the branch's
                    exc.param = "messages" if job.kind == "chat" else "prompt"
                    raise
                except UnsupportedByBranchError as exc:
                    breakers.release(branch.id)  # what the request asks, not a failure
                    if job.decision.pinned:
                        raise
                    job.trace.skipped(branch, "unsupported")
                    unsupported = exc
                    if tried == 1:  # nothing ran yet: the next branch is not a retry
                        tried = 0
                    continue
                except EngineError as exc:
                    current = serves(routes.current, branch)
                    if isinstance(exc, DeviceOutOfMemoryError) or not current:
                        # the device's state, not the branch's fault: residency and the memory
                        # filter deal with it, and a breaker would keep the one branch that
                        # still fits shut for its open time after memory is back. Or a worker
                        # a reload replaced: its end is not its successor's failure
                        breakers.release(branch.id)
                        retired = retired or not current
                    else:
                        breakers.failure(branch.id)
                    job.trace.attempt_failed(branch, exc)
                    last = exc
                    log.warning(
                        "job %s: branch %s failed before its first token: %s",
                        job.id,
                        branch.id,
                        exc.message,
                    )
                    continue
                except BaseException:
                    breakers.release(branch.id)
                    raise
                return run
        except BaseException:
            budget.finish(retries)
            self.abandon(job)
            raise
        budget.finish(retries)
        self.abandon(job)
        if unsupported is not None and last is None:
            raise unsupported  # no branch that could do it was tried
        if last is not None and len(job.branches) == 1 and not retired:
            raise last
        raise ServiceUnavailableError(
            f"every branch of {job.decision.model} failed or is shedding load; retry later",
            retry_after_s=self._retry_after_s,
        )

    async def _open(self, job: Job, branch: Branch, retries: int) -> Run:
        """Every choice of ``job`` on ``branch``, up to its first token; raises an
        ``EngineError`` (after closing what it opened) if the branch fails before."""
        timeout_s = self._first_token_timeout_s
        by_deadline = job.deadline is not None and job.deadline - time.monotonic() < timeout_s
        if job.deadline is not None:
            timeout_s = min(timeout_s, max(0.0, job.deadline - time.monotonic()))
        streams: list[AsyncIterator[EngineEvent]] = []
        pending: list[list[EngineEvent]] = []
        prompt_tokens: list[int] = []
        cached_tokens: list[int] = []
        drafted = False
        opened = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                for request in job.requests:
                    streams.append(aiter(branch.engine.generate(job.trace.carry(request))))
                    pending.append([])
                await _to_first_tokens(streams, pending)
            for events in pending:
                if not isinstance(events[0], StartEvent):
                    raise EngineError(f"branch {branch.id} skipped its start event")
                prompt_tokens.append(events[0].prompt_tokens)
                cached_tokens.append(events[0].cached_tokens)
                drafted = drafted or events[0].drafted
            job.trace.first_token(sum(cached_tokens[:: job.n]))
        except TimeoutError as exc:
            await close_all(streams)
            if by_deadline:  # the client's deadline, not the branch's failure: no fallback
                raise ServiceUnavailableError(
                    "the request's deadline passed before its first token",
                    retry_after_s=self._retry_after_s,
                ) from exc
            raise EngineError(
                f"branch {branch.id} sent no first token in {timeout_s:.3g} s"
            ) from exc
        except StopAsyncIteration as exc:
            await close_all(streams)
            raise EngineError(f"branch {branch.id} ended a stream without finishing") from exc
        except BaseException:
            await close_all(streams)
            raise

        def done(run: Run, ok: bool | None) -> None:
            self._budget.finish(retries)
            self.abandon(job, run.usage_tokens)
            job.trace.done(ok)
            if not serves(self._routes.current, branch):
                return  # a replaced worker's verdict is not its successor's (a fresh breaker)
            if ok is True:
                self._breakers.success(branch.id)
            elif ok is False:
                self._breakers.failure(branch.id)
            else:
                self._breakers.release(branch.id)

        return Run(
            job,
            branch,
            streams,
            prompt_tokens,
            self._finished,
            cached_tokens=cached_tokens,
            drafted=drafted,
            pending=pending,
            on_done=done,
            opened=opened,
        )


def serves(table: RouteTable, branch: Branch) -> bool:
    """Whether ``branch``'s worker is the one ``table`` serves its id with (a reload may
    have replaced it; the replaced one drains)."""
    route = table.models.get(branch.model)
    now = route.branch(branch.name) if route is not None else None
    return now is not None and now.engine is branch.engine


def _successor(table: RouteTable, branch: Branch, *, pinned: bool) -> Branch:
    """The branch the table serves ``branch``'s id with now, where that keeps what the
    job was routed for: a job routed before a reload runs on the new worker. ``branch``
    itself when the table no longer has the id, or when the id now names a file that is
    not known to be as faithful (:func:`as_faithful`): the request's quality bound was
    checked against the old file's profile, so it runs on the old worker while that
    drains, or fails over to the decision's next branch. A pinned job (the client named
    the branch) takes whatever the id names now, unless the id now names another engine:
    the job was shaped for the old one (a rendered prompt, or the messages), so it stays
    there, pinned or not."""
    route = table.models.get(branch.model)
    now = route.branch(branch.name) if route is not None else None
    if now is None or now is branch or now.artifact.engine != branch.artifact.engine:
        return branch
    if pinned or as_faithful(branch, now, reference=route.reference if route else ""):
        return now
    return branch


def as_faithful(old: Branch, new: Branch, *, reference: str) -> bool:
    """Whether ``new`` meets every quality bound ``old`` met (``reference``: the name of
    the reference branch of ``new``'s route): the same file; the reference (it meets any
    bound); an ``old`` that was neither profiled nor the reference (only an unbounded
    request could be routed to it); or a profile no worse in mean KLD and top-1."""
    if new.artifact.sha256 == old.artifact.sha256 or new.name == reference:
        return True
    if old.artifact.is_reference:
        return False  # a bound only the reference met (max_kld 0) may not hold for new
    if old.profile is None:
        return True
    return (
        new.profile is not None
        and new.profile.mean_kld <= old.profile.mean_kld
        and new.profile.top1 >= old.profile.top1
    )


def _committed(events: list[EngineEvent]) -> bool:
    return bool(events) and isinstance(events[-1], TokenEvent | FinishEvent)


async def _to_first_tokens(
    streams: list[AsyncIterator[EngineEvent]], pending: list[list[EngineEvent]]
) -> None:
    """Read every choice into ``pending`` up to its first token (or its end). With several
    choices, all are read at once, and a choice that has its first token goes on being
    read until every sibling has one: left unread, it would pause in the worker holding a
    slot its sibling waits for, and n > 1 requests on a full worker would wait on each
    other. What it reads meanwhile is bounded by its ``max_tokens``."""
    if len(streams) == 1:
        events = pending[0]
        events.append(await anext(streams[0]))
        while not _committed(events):
            events.append(await anext(streams[0]))
        return
    reads = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            failed = next((r for r in done if r.exception() is not None), None)
            if failed is not None:
                for read in done:  # every result retrieved: none is left unread
                    read.exception()
                    reads.pop(read)
                failed.result()  # an engine error, or a stream that ended early
            for read in done:
                i = reads.pop(read)
                event = read.result()
                pending[i].append(event)
                waiting = not all(_committed(events) for events in pending)
                if not isinstance(event, FinishEvent) and (waiting or not _committed(pending[i])):
                    reads[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for read in reads:  # failed or timed out: the streams are closed next
            read.cancel()
        if reads:
            await asyncio.wait(reads)

"""The one service object routes call: request → decision → engine run.

``prepare`` turns a validated request into a :class:`Job` (prompts, sampling,
the routing decision); ``start`` runs it on the first branch that accepts
it, falling back to the next branch of the decision when one fails before
its first token; the returned :class:`Run` yields ``(choice index, event)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest, check_limits
from quantroute.config import Settings
from quantroute.engines.base import (
    EngineEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.chat_template import render_chat
from quantroute.errors import (
    ContextLengthExceededError,
    EngineError,
    QuantrouteError,
    ServiceUnavailableError,
)
from quantroute.routing.policy import Decision, choose, parse_model_ref
from quantroute.routing.requirement import (
    DEADLINE_HEADER,
    QUALITY_HEADER,
    Requirement,
    parse_requirement,
)
from quantroute.routing.scoring import (
    BranchState,
    RequestShape,
    RouteDecision,
    choose_branch,
    explain,
)
from quantroute.routing.table import Branch, RouteTableRef

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
_SEED_MASK = 2**64 - 1
_AFFINITY_PREFIX_CHARS = 256
_WAIT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: Kind
    decision: Decision
    requests: tuple[GenerationRequest, ...]  # one per choice index
    n: int  # choices per prompt: request i answers prompt i // n
    stream: bool
    include_usage: bool
    logprobs: bool


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing happened for a keep-alive interval."""


class Run:
    """A job started on one branch: merged events of its choices."""

    def __init__(
        self,
        job: Job,
        branch: Branch,
        streams: list[AsyncIterator[EngineEvent]],
        prompt_tokens: list[int],
        on_finished: Callable[[Run, list[int]], None] | None = None,
    ):
        self.job = job
        self.branch = branch
        self.prompt_tokens = prompt_tokens
        self._streams = streams
        self._on_finished = on_finished
        self._queue: asyncio.Queue[tuple[int, EngineEvent] | BaseException | None] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []

    async def events(
        self, keepalive_s: float | None = None
    ) -> AsyncIterator[tuple[int, EngineEvent] | Tick]:
        """Every choice's events, interleaved as they come; ``Tick`` when idle."""
        self._pumps = [
            asyncio.create_task(self._pump(i, s), name=f"pump:{self.job.id}:{i}")
            for i, s in enumerate(self._streams)
        ]
        remaining = len(self._pumps)
        try:
            while remaining:
                if not self._queue.empty():
                    item = self._queue.get_nowait()  # the common case: no timer, no task
                else:
                    try:
                        item = await asyncio.wait_for(self._queue.get(), keepalive_s)
                    except TimeoutError:
                        yield Tick()
                        continue
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def _pump(self, index: int, stream: AsyncIterator[EngineEvent]) -> None:
        tokens: list[int] = []  # of choice 0, for the drift monitor
        try:
            async for event in stream:
                self._queue.put_nowait((index, event))
                if index == 0 and isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                elif index == 0 and isinstance(event, FinishEvent) and self._on_finished:
                    self._on_finished(self, tokens)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(None)

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


class CompletionService:
    def __init__(
        self,
        routes: RouteTableRef,
        settings: Settings,
        *,
        degraded: Callable[[str], bool] = lambda branch_id: False,
        on_finished: Callable[[Run, list[int]], None] | None = None,
        states: Callable[[str], Sequence[BranchState]] | None = None,
        admit: Callable[[Branch], None] = lambda branch: None,
    ):
        self._routes = routes
        self._settings = settings
        self._degraded = degraded
        self._on_finished = on_finished
        self._states = states  # None: route by precision only (tables of fake engines)
        self._admit = admit  # may raise an EngineError: the branch cannot take it now

    def route(
        self, req: ChatCompletionRequest | CompletionRequest, headers: Mapping[str, str]
    ) -> tuple[Decision, RouteDecision | None]:
        """Which branches answer ``req``, in order. A pinned branch answers alone; a
        model name goes through the routing policy (requirement, filters, score)."""
        name, pinned = parse_model_ref(req.model)
        table = self._routes.current
        if pinned is not None or self._states is None or name not in table.models:
            return choose(table, req.model, degraded=self._degraded), None
        requirement, shape, states = self._routing_inputs(name, req, headers)
        routed = choose_branch(requirement, shape, states, self._settings.routing)
        route = table.models[name]
        branches = tuple(b for i in routed.branch_ids for b in route.branches if b.id == i)
        return Decision(name, branches, routed.reason, False), routed

    def _routing_inputs(
        self,
        name: str,
        req: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str],
    ) -> tuple[Requirement, RequestShape, Sequence[BranchState]]:
        assert self._states is not None
        requirement = parse_requirement(
            req.quality,
            headers.get(QUALITY_HEADER),
            headers.get(DEADLINE_HEADER),
            req.timeout,
            req.priority,
            self._settings.routing,
        )
        text = _prompt_text(req)
        limit = req.completion_limit if isinstance(req, ChatCompletionRequest) else req.max_tokens
        shape = RequestShape(
            # an upper bound: a token is at least one byte of text
            prompt_tokens=len(text.encode()) + 1,
            max_tokens=limit or self._settings.limits.max_tokens,
            prefix=text[:_AFFINITY_PREFIX_CHARS],
        )
        return requirement, shape, self._states(name)

    def explain(
        self, req: ChatCompletionRequest | CompletionRequest, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """The decision for ``req`` without running it: per branch, each filter and the score."""
        check_limits(req, self._settings.limits)
        name, pinned = parse_model_ref(req.model)
        body: dict[str, Any] = {"model": name}
        if pinned is not None or self._states is None or name not in self._routes.current.models:
            decision = choose(self._routes.current, req.model, degraded=self._degraded)
            body["decision"] = {
                "branches": [b.id for b in decision.branches],
                "reason": decision.reason,
                "wait_s": None,
            }
            body["branches"] = []
            return body
        requirement, shape, states = self._routing_inputs(name, req, headers)
        body["requirement"] = {
            "tier": requirement.tier,
            "max_kld": requirement.max_kld,
            "min_top1": requirement.min_top1,
            "deadline_ms": requirement.deadline_ms,
            "priority": requirement.priority,
            "explicit": requirement.explicit,
        }
        body["request"] = {"prompt_tokens_max": shape.prompt_tokens, "max_tokens": shape.max_tokens}
        try:
            routed = choose_branch(requirement, shape, states, self._settings.routing)
            body["decision"] = {
                "branches": list(routed.branch_ids),
                "reason": routed.reason,
                "wait_s": routed.wait_s,
            }
        except QuantrouteError as exc:
            body["decision"] = {
                "branches": [],
                "reason": "infeasible",
                "error": exc.to_openai()["error"],
            }
        body["branches"] = [
            e.to_dict() for e in explain(requirement, shape, states, self._settings.routing)
        ]
        return body

    async def decide(
        self, req: ChatCompletionRequest | CompletionRequest, headers: Mapping[str, str]
    ) -> Decision:
        """``route``, waiting where the tier says to wait (``exact``: for the reference)."""
        decision, routed = self.route(req, headers)
        if routed is None or routed.wait_s is None:
            return decision
        deadline = time.monotonic() + routed.wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(_WAIT_POLL_S)
            decision, _ = self.route(req, headers)
            if decision.branches:
                return decision
        raise ServiceUnavailableError(
            f"no branch of {decision.model} met the request's quality bound in time",
            retry_after_s=self._settings.routing.retry_after_s,
        )

    async def prepare(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str] | None = None,
    ) -> Job:
        check_limits(req, self._settings.limits)
        decision = await self.decide(req, headers or {})
        job_id = uuid.uuid4().hex
        seed = None if req.seed is None else req.seed & _SEED_MASK
        base = SamplingParams(
            max_tokens=self._settings.limits.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=seed,
            stop=req.stops,
            logit_bias=req.bias,
            ignore_eos=req.ignore_eos,
        )
        if isinstance(req, ChatCompletionRequest):
            info = decision.branches[0].engine.info
            prompt = render_chat(
                [{"role": m.role, "content": m.text} for m in req.messages],
                model_template=info.chat_template if info else None,
                bos_token=info.bos_token if info else "",
                eos_token=info.eos_token if info else "",
            )
            limit = req.completion_limit
            sampling = replace(
                base,
                max_tokens=limit or base.max_tokens,
                fit_context=limit is None,
                stop=base.stop + prompt.stops,
                logprobs=req.logprobs,
                top_logprobs=req.top_logprobs or 0,
            )
            prompts = [prompt.text] * req.n
            special = prompt.template == "model"
            kind: Kind = "chat"
            logprobs = req.logprobs
        else:
            sampling = replace(
                base,
                max_tokens=req.max_tokens or base.max_tokens,
                fit_context=req.max_tokens is None,
                logprobs=req.logprobs is not None,
                top_logprobs=req.logprobs or 0,
            )
            prompts = [p for p in req.prompts for _ in range(req.n)]
            special = False
            kind = "completion"
            logprobs = req.logprobs is not None
        requests = tuple(
            GenerationRequest(
                f"{job_id}.{i}",
                prompt,
                sampling if seed is None else replace(sampling, seed=(seed + i) & _SEED_MASK),
                parse_special=special,
            )
            for i, prompt in enumerate(prompts)
        )
        return Job(job_id, kind, decision, requests, req.n, req.stream, req.include_usage, logprobs)

    async def start(self, job: Job) -> Run:
        """Open every choice on the first branch that takes them all."""
        last: EngineError | None = None
        for branch in job.decision.branches:
            streams: list[AsyncIterator[EngineEvent]] = []
            try:
                self._admit(branch)
                prompt_tokens = []
                for request in job.requests:
                    stream = aiter(branch.engine.generate(request))
                    streams.append(stream)
                    first = await anext(stream)
                    if not isinstance(first, StartEvent):
                        raise EngineError(f"branch {branch.id} skipped its start event")
                    prompt_tokens.append(first.prompt_tokens)
                return Run(job, branch, streams, prompt_tokens, self._on_finished)
            except ContextLengthExceededError as exc:
                exc.param = "messages" if job.kind == "chat" else "prompt"
                await _close_all(streams)
                raise
            except EngineError as exc:
                last = exc
                log.warning(
                    "job %s: branch %s failed before its first token: %s",
                    job.id,
                    branch.id,
                    exc.message,
                )
                await _close_all(streams)
            except BaseException:
                await _close_all(streams)
                raise
        if last is not None and len(job.decision.branches) == 1:
            raise last
        raise ServiceUnavailableError(
            f"every branch of {job.decision.model} failed before answering", retry_after_s=2.0
        )


def _prompt_text(req: ChatCompletionRequest | CompletionRequest) -> str:
    if isinstance(req, ChatCompletionRequest):
        return "\n".join(m.text for m in req.messages)
    return req.prompts[0]


async def _close_all(streams: list[AsyncIterator[EngineEvent]]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

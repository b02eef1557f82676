"""The one service object the HTTP routes call: request → decision → engine run, and the
read-only views and operator actions around it.

``prepare`` turns a validated request into a :class:`Job` (prompts, sampling,
the routing decision); ``start`` runs it on the first branch that accepts
it, falling back to the next branch of the decision when one fails before
its first token; the returned :class:`Run` yields ``(choice index, event)``.
``explain``, ``models``, ``devices``, ``readiness`` and ``metrics`` report;
``set_pressure`` and ``restart`` act (admin).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from quantroute.api import views
from quantroute.api.jobs import Job, Run, build_job, close_all
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest, check_limits
from quantroute.engines.base import (
    EngineEvent,
    FinishEvent,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.chat_template import render_chat
from quantroute.errors import (
    ContextLengthExceededError,
    DeviceOutOfMemoryError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    QuantrouteError,
    ServiceUnavailableError,
)
from quantroute.routing.policy import Decision, choose, explain, pinned
from quantroute.routing.records import RequestShape
from quantroute.routing.requirement import (
    DEADLINE_HEADER,
    QUALITY_HEADER,
    Requirement,
    parse_requirement,
)
from quantroute.routing.table import Branch, ModelRoute, lookup

if TYPE_CHECKING:
    from quantroute.api.gateway import Gateway

log = logging.getLogger(__name__)

Request = ChatCompletionRequest | CompletionRequest
_SEED_MASK = 2**64 - 1
_AFFINITY_PREFIX_CHARS = 256
_WAIT_POLL_S = 0.05


class Service:
    """What the routes may ask of the gateway; it never hands out the gateway's parts."""

    def __init__(self, gateway: Gateway):
        self._gateway = gateway
        self._settings = gateway.settings

    # -- routing ----------------------------------------------------------------

    def route(
        self, req: Request, headers: Mapping[str, str]
    ) -> tuple[Decision, ModelRoute, Requirement]:
        """Which branches answer ``req``, in order. A pinned branch answers alone; a
        model name goes through the routing policy (requirement, filters, score).
        The requirement is parsed either way: a malformed header is a 400 for a pinned
        request too, and its deadline bounds the wait for the first token."""
        route, branch = lookup(self._gateway.routes.current, req.model)
        requirement, shape = self._routing_inputs(req, headers)
        if branch is not None:
            ready = self._gateway.residency.routable(branch)
            retry_s = self._settings.routing.retry_after_s
            decision = pinned(route.name, branch.id, ready=ready, retry_after_s=retry_s)
            return decision, route, requirement
        states = self._gateway.states.read(route.name)
        decision = choose(route.name, requirement, shape, states, self._settings.routing)
        return decision, route, requirement

    def _routing_inputs(
        self, req: Request, headers: Mapping[str, str]
    ) -> tuple[Requirement, RequestShape]:
        requirement = parse_requirement(
            req.quality,
            headers.get(QUALITY_HEADER),
            headers.get(DEADLINE_HEADER),
            req.timeout,
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
        return requirement, shape

    def explain(self, req: Request, headers: Mapping[str, str]) -> dict[str, Any]:
        """The decision for ``req`` without running it: per branch, each filter and the score."""
        check_limits(req, self._settings.limits)
        route, branch = lookup(self._gateway.routes.current, req.model)
        body: dict[str, Any] = {"model": route.name}
        if branch is not None:
            ready = self._gateway.residency.routable(branch)
            body["decision"] = {
                "branches": [branch.id] if ready else [],
                "reason": "pinned" if ready else "pinned:not-ready",
                "wait_s": None,
            }
            body["branches"] = []
            return body
        requirement, shape = self._routing_inputs(req, headers)
        states = self._gateway.states.read(route.name)
        body["requirement"] = {
            "tier": requirement.tier,
            "max_kld": requirement.max_kld,
            "min_top1": requirement.min_top1,
            "deadline_ms": requirement.deadline_ms,
            "explicit": requirement.explicit,
        }
        body["request"] = {"prompt_tokens_max": shape.prompt_tokens, "max_tokens": shape.max_tokens}
        settings = self._settings.routing
        try:
            decision = choose(route.name, requirement, shape, states, settings)
            body["decision"] = {
                "branches": list(decision.branch_ids),
                "reason": decision.reason,
                "wait_s": decision.wait_s,
            }
        except QuantrouteError as exc:
            body["decision"] = {
                "branches": [],
                "reason": "infeasible",
                "error": exc.to_openai()["error"],
            }
        body["branches"] = [e.to_dict() for e in explain(requirement, shape, states, settings)]
        return body

    async def decide(
        self, req: Request, headers: Mapping[str, str]
    ) -> tuple[Decision, tuple[Branch, ...], float | None]:
        """``route``, waiting where the tier says to wait (``exact``: for the reference).
        Also the request's deadline (monotonic seconds), if it has one."""
        decision, route, requirement = self.route(req, headers)
        ms = requirement.deadline_ms
        deadline = None if ms is None else time.monotonic() + ms / 1000.0
        if decision.wait_s is not None:
            wait_until = time.monotonic() + decision.wait_s
            deadline = time.monotonic() + decision.wait_s
            while not decision.branch_ids:
                if time.monotonic() >= wait_until:
                    raise ServiceUnavailableError(
                        f"no branch of {decision.model} met the request's quality bound in time",
                        retry_after_s=self._settings.routing.retry_after_s,
                    )
                await asyncio.sleep(_WAIT_POLL_S)
                decision, route, _ = self.route(req, headers)
        return decision, route.by_id(decision.branch_ids), deadline

    # -- running ----------------------------------------------------------------

    async def prepare(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str] | None = None,
    ) -> Job:
        check_limits(req, self._settings.limits)
        decision, branches, deadline = await self.decide(req, headers or {})
        prompt = None
        if isinstance(req, ChatCompletionRequest):
            info = branches[0].engine.info
            prompt = render_chat(
                [{"role": m.role, "content": m.text} for m in req.messages],
                model_template=info.chat_template if info else None,
                bos_token=info.bos_token if info else "",
                eos_token=info.eos_token if info else "",
            )
        return build_job(
            req,
            decision,
            branches,
            prompt,
            max_tokens=self._settings.limits.max_tokens,
            deadline=deadline,
        )

    async def start(self, job: Job) -> Run:
        """Open every choice on the first branch that takes them all.

        The commit point is each choice's first token: until then any failure of the
        branch (an error, its worker's death, an out-of-memory, no first token in
        ``resilience.first_token_timeout_s`` or by the deadline) moves the request to
        the decision's next branch, within the retry budget. A branch whose breaker
        is open is passed over (that is not its failure). Afterwards an error ends the
        stream (an error event, no ``[DONE]``)."""
        gateway = self._gateway
        budget = gateway.retry_budget
        budget.start()
        retries = 0
        last: EngineError | None = None
        tried = 0
        try:
            for branch in job.branches:
                if not gateway.breakers.acquire(branch.id):
                    continue  # open: its own rejection, never counted as a failure
                if tried and not budget.try_retry():
                    gateway.breakers.release(branch.id)
                    log.warning("job %s: retry budget spent; not trying %s", job.id, branch.id)
                    break
                retries += 1 if tried else 0
                tried += 1
                try:
                    run = await self._open(job, branch, retries)
                except ContextLengthExceededError as exc:
                    gateway.breakers.release(branch.id)  # the request's fault, not the branch's
                    exc.param = "messages" if job.kind == "chat" else "prompt"
                    raise
                except EngineError as exc:
                    gateway.breakers.failure(branch.id)
                    last = exc
                    log.warning(
                        "job %s: branch %s failed before its first token: %s",
                        job.id,
                        branch.id,
                        exc.message,
                    )
                    continue
                except BaseException:
                    gateway.breakers.release(branch.id)
                    raise
                return run
        except BaseException:
            budget.finish(retries)
            raise
        budget.finish(retries)
        if last is not None and len(job.branches) == 1:
            raise last
        raise ServiceUnavailableError(
            f"every branch of {job.decision.model} failed or is shedding load; retry later",
            retry_after_s=self._settings.routing.retry_after_s,
        )

    async def _open(self, job: Job, branch: Branch, retries: int) -> Run:
        """Every choice of ``job`` on ``branch``, up to its first token; raises an
        ``EngineError`` (after closing what it opened) if the branch fails before."""
        if not self._gateway.occupancy.admit(branch.id):
            raise DeviceOutOfMemoryError(f"the device of branch {branch.id} is out of memory")
        timeout_s = self._settings.resilience.first_token_timeout_s
        if job.deadline is not None:
            timeout_s = min(timeout_s, max(0.0, job.deadline - time.monotonic()))
        streams: list[AsyncIterator[EngineEvent]] = []
        pending: list[list[EngineEvent]] = []
        prompt_tokens: list[int] = []
        try:
            async with asyncio.timeout(timeout_s):
                for request in job.requests:
                    stream = aiter(branch.engine.generate(request))
                    streams.append(stream)
                    first = await anext(stream)
                    if not isinstance(first, StartEvent):
                        raise EngineError(f"branch {branch.id} skipped its start event")
                    prompt_tokens.append(first.prompt_tokens)
                    events: list[EngineEvent] = [first]
                    while not isinstance(events[-1], TokenEvent | FinishEvent):
                        events.append(await anext(stream))
                    pending.append(events)
        except TimeoutError as exc:
            await close_all(streams)
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
            self._gateway.retry_budget.finish(retries)
            if ok is True:
                self._gateway.breakers.success(branch.id)
            elif ok is False:
                self._gateway.breakers.failure(branch.id)
            else:
                self._gateway.breakers.release(branch.id)

        return Run(
            job,
            branch,
            streams,
            prompt_tokens,
            self._gateway.finished,
            pending=pending,
            on_done=done,
        )

    # -- views and operator actions ----------------------------------------------

    def models(self) -> dict[str, Any]:
        """The body of ``GET /v1/models``."""
        return views.models_json(self._gateway)

    def devices(self) -> dict[str, Any]:
        """The body of ``GET /v1/devices``."""
        return views.devices_json(self._gateway)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``GET /readyz``: ready when every model has a branch that takes traffic."""
        return views.readiness_json(self._gateway)

    def metrics(self) -> bytes:
        """Prometheus text exposition of branches and devices."""
        return views.metrics_text(self._gateway)

    def status(self) -> dict[str, Any]:
        """``GET /admin/status``: branch states, circuit breakers, the retry budget."""
        return views.status_json(self._gateway)

    def set_pressure(self, device_id: str, nbytes: int) -> None:
        """Simulated devices only: occupy ``nbytes`` of a device, as another tenant would."""
        sim = self._gateway.occupancy.sim
        if sim is None:
            raise InvalidRequestError("pressure can only be set on simulated devices")
        if device_id not in sim.device_ids:
            raise NotFoundError("No such simulated device.", param="device_id", code="not_found")
        sim.set_pressure(device_id, nbytes)

    async def restart(self, branch_ref: str) -> dict[str, Any]:
        """Restart a branch (``model:branch``), clearing its failure; the answer says how it
        came back."""
        _, branch = lookup(self._gateway.routes.current, branch_ref)
        if branch is None:
            raise InvalidRequestError(
                "name a branch (model:branch), not a model", param="branch_id"
            )
        await self._gateway.restart(branch)
        return {
            "branch": branch.id,
            "ready": branch.engine.ready,
            "failure": branch.engine.failure,
        }


def _prompt_text(req: ChatCompletionRequest | CompletionRequest) -> str:
    if isinstance(req, ChatCompletionRequest):
        return "\n".join(m.text for m in req.messages)
    return req.prompts[0]

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
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from quantroute.api import views
from quantroute.api.jobs import Job, Kind, Run, close_all
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest, check_limits
from quantroute.engines.base import EngineEvent, GenerationRequest, SamplingParams, StartEvent
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

    def route(self, req: Request, headers: Mapping[str, str]) -> tuple[Decision, ModelRoute]:
        """Which branches answer ``req``, in order. A pinned branch answers alone; a
        model name goes through the routing policy (requirement, filters, score)."""
        route, branch = lookup(self._gateway.routes.current, req.model)
        if branch is not None:
            ready = self._gateway.residency.routable(branch)
            retry_s = self._settings.routing.retry_after_s
            return pinned(route.name, branch.id, ready=ready, retry_after_s=retry_s), route
        requirement, shape = self._routing_inputs(req, headers)
        states = self._gateway.states.read(route.name)
        return choose(route.name, requirement, shape, states, self._settings.routing), route

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
    ) -> tuple[Decision, tuple[Branch, ...]]:
        """``route``, waiting where the tier says to wait (``exact``: for the reference)."""
        decision, route = self.route(req, headers)
        if decision.wait_s is not None:
            deadline = time.monotonic() + decision.wait_s
            while not decision.branch_ids:
                if time.monotonic() >= deadline:
                    raise ServiceUnavailableError(
                        f"no branch of {decision.model} met the request's quality bound in time",
                        retry_after_s=self._settings.routing.retry_after_s,
                    )
                await asyncio.sleep(_WAIT_POLL_S)
                decision, route = self.route(req, headers)
        return decision, route.by_id(decision.branch_ids)

    # -- running ----------------------------------------------------------------

    async def prepare(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str] | None = None,
    ) -> Job:
        check_limits(req, self._settings.limits)
        decision, branches = await self.decide(req, headers or {})
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
            info = branches[0].engine.info
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
        return Job(
            job_id,
            kind,
            decision,
            branches,
            requests,
            req.n,
            req.stream,
            req.include_usage,
            logprobs,
        )

    async def start(self, job: Job) -> Run:
        """Open every choice on the first branch that takes them all."""
        last: EngineError | None = None
        for branch in job.branches:
            streams: list[AsyncIterator[EngineEvent]] = []
            try:
                if not self._gateway.occupancy.admit(branch.id):
                    raise DeviceOutOfMemoryError(
                        f"the device of branch {branch.id} is out of memory"
                    )
                prompt_tokens = []
                for request in job.requests:
                    stream = aiter(branch.engine.generate(request))
                    streams.append(stream)
                    first = await anext(stream)
                    if not isinstance(first, StartEvent):
                        raise EngineError(f"branch {branch.id} skipped its start event")
                    prompt_tokens.append(first.prompt_tokens)
                return Run(job, branch, streams, prompt_tokens, self._gateway.finished)
            except ContextLengthExceededError as exc:
                exc.param = "messages" if job.kind == "chat" else "prompt"
                await close_all(streams)
                raise
            except EngineError as exc:
                last = exc
                log.warning(
                    "job %s: branch %s failed before its first token: %s",
                    job.id,
                    branch.id,
                    exc.message,
                )
                await close_all(streams)
            except BaseException:
                await close_all(streams)
                raise
        if last is not None and len(job.branches) == 1:
            raise last
        raise ServiceUnavailableError(
            f"every branch of {job.decision.model} failed before answering", retry_after_s=2.0
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

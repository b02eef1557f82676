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
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from quantroute import __version__
from quantroute.api import views
from quantroute.api.grammars import Grammars
from quantroute.api.jobs import Job, build_job
from quantroute.api.run import Run
from quantroute.api.runner import Runner
from quantroute.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_limits,
    check_vocabulary,
)
from quantroute.api.tools import template_messages
from quantroute.errors import (
    InvalidRequestError,
    NotFoundError,
    QuantrouteError,
    RateLimitError,
    ServiceUnavailableError,
)
from quantroute.observability import RequestTrace
from quantroute.resilience.tenants import OPEN, Tenant
from quantroute.routing.policy import Decision, Explanation, choose, explain, pinned
from quantroute.routing.records import RequestShape
from quantroute.routing.requirement import (
    DEADLINE_HEADER,
    QUALITY_HEADER,
    Requirement,
    parse_requirement,
)
from quantroute.routing.table import Branch, ModelRoute, lookup
from quantroute.routing.versions import Audience
from quantroute.shaping.chat_template import render_chat_bounded

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
        self._runner = Runner(gateway)
        self._grammars = Grammars(self._settings.limits.compile_timeout_s)
        self._build: asyncio.Future[dict[str, str]] | None = None  # GET /version's llama.cpp

    # -- routing ----------------------------------------------------------------

    def route(
        self,
        req: Request,
        requirement: Requirement,
        shape: RequestShape,
        who: Audience | None = None,
    ) -> tuple[Decision, ModelRoute]:
        """Which branches answer ``req``, in order. A versioned model's version is
        ``who``'s (``routing.versions``); a pinned branch answers alone; a model name
        goes through the routing policy (requirement, filters, score)."""
        route, branch = lookup(self._gateway.routes.current, req.model, who)
        if branch is not None:
            ready = self._gateway.residency.routable(branch)
            retry_s = self._settings.routing.retry_after_s
            return pinned(route.name, branch.id, ready=ready, retry_after_s=retry_s), route
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
        limit = req.limit
        ids = req.token_prompts if isinstance(req, CompletionRequest) else None
        shape = RequestShape(
            # an upper bound: a token is at least one byte of text
            prompt_tokens=max(map(len, ids)) if ids else len(text.encode()) + 1,
            max_tokens=limit or self._settings.limits.max_tokens,
            prefix=text[:_AFFINITY_PREFIX_CHARS],
        )
        return requirement, shape

    def explain(
        self, req: Request, headers: Mapping[str, str], tenant: Tenant = OPEN
    ) -> dict[str, Any]:
        """The decision for ``req`` without running it: per branch, each filter and the score."""
        check_limits(req, self._settings.limits)
        who = Audience.of(req.user, headers)
        route, branch = lookup(self._gateway.routes.current, req.model, who, _limited(tenant))
        requirement, shape = self._routing_inputs(req, headers)  # a bad header is a 400 here too
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
        states = self._gateway.states.read(route.name)
        fields = ("tier", "max_kld", "min_top1", "deadline_ms", "explicit")
        body["requirement"] = {f: getattr(requirement, f) for f in fields}
        body["request"] = {"prompt_tokens_max": shape.prompt_tokens, "max_tokens": shape.max_tokens}
        settings = self._settings.routing
        explained: tuple[Explanation, ...] = ()  # the decision's own: with each place in it
        try:
            decision = choose(route.name, requirement, shape, states, settings)
            body["decision"] = {
                "branches": list(decision.branch_ids),
                "reason": decision.reason,
                "wait_s": decision.wait_s,
            }
            explained = decision.explanations
        except QuantrouteError as exc:
            body["decision"] = {
                "branches": [],
                "reason": "infeasible",
                "error": exc.to_openai()["error"],
            }
        if not explained:  # nothing chosen (a wait, a 503): the filters and scores alone
            explained = explain(requirement, shape, states, settings)
        body["branches"] = [e.to_dict() for e in explained]
        return body

    async def decide(
        self,
        req: Request,
        requirement: Requirement,
        shape: RequestShape,
        who: Audience | None = None,
    ) -> tuple[Decision, tuple[Branch, ...]]:
        """``route``, waiting where the tier says to wait (``exact``: for the reference)."""
        decision, route = self.route(req, requirement, shape, who)
        if decision.wait_s is not None:
            wait_until = time.monotonic() + decision.wait_s
            while not decision.branch_ids:
                if time.monotonic() >= wait_until:
                    raise ServiceUnavailableError(
                        f"no branch of {decision.model} met the request's quality bound in time",
                        retry_after_s=self._settings.routing.retry_after_s,
                    )
                await asyncio.sleep(_WAIT_POLL_S)
                decision, route = self.route(req, requirement, shape, who)
        return decision, route.by_id(decision.branch_ids)

    # -- running ----------------------------------------------------------------

    async def prepare(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str] | None = None,
        tenant: Tenant = OPEN,
    ) -> Job:
        """Check the request, admit it (tenant limits, the model's queue), route it, and
        build its engine requests. The job holds its admission ticket from here on:
        ``start`` (or, if it is never started, :meth:`abandon`) gives it back."""
        headers = headers or {}
        trace = self._gateway.observer.begin(req, headers, tenant.name)
        with trace.failing():
            return await self._prepare(req, headers, tenant, trace)

    async def _prepare(
        self, req: Request, headers: Mapping[str, str], tenant: Tenant, trace: RequestTrace
    ) -> Job:
        check_limits(req, self._settings.limits)  # cheap checks first, then the tenant's limits
        gateway = self._gateway
        who = Audience.of(req.user, headers)
        route, _ = lookup(gateway.routes.current, req.model, who, _limited(tenant))
        over = gateway.limits.check(tenant)
        if over is not None:
            limit, retry_s = over
            raise RateLimitError(
                f"this key is over its {limit.replace('_', ' ')} limit", retry_after_s=retry_s
            )
        stamp = gateway.limits.started(tenant)  # counted now: no wait since the check
        try:  # what the client chose to cost: after the limits, off the loop, bounded
            grammar = await self._grammars.of(req)
        except BaseException:
            gateway.limits.finished(tenant, 0)  # it ran: it counts in the tenant's minute
            raise
        try:
            return await self._admit(req, headers, tenant, route.name, trace, who, grammar)
        except BaseException:
            gateway.limits.withdrawn(tenant, stamp)
            raise

    async def _admit(
        self,
        req: Request,
        headers: Mapping[str, str],
        tenant: Tenant,
        model: str,
        trace: RequestTrace,
        who: Audience,
        grammar: str | None,
    ) -> Job:
        """The model's admission queue, routing and the engine requests of ``prepare``."""
        gateway = self._gateway
        # parsed here, for pinned requests too: a malformed header is a 400 either way, and
        # the deadline bounds the queue, the first token and the generation
        requirement, shape = self._routing_inputs(req, headers)
        ms = requirement.deadline_ms
        deadline = None if ms is None else time.monotonic() + ms / 1000.0
        ticket = await gateway.admission.enter(
            model,
            capacity=gateway.capacity(model),
            priority=tenant.priority_for(req.priority),  # capped at its max_priority
            tenant=tenant.name,
            deadline=deadline,
        )
        trace.admitted(model, ticket.waited_s)
        try:
            requirement = _after_queue(requirement, ticket.waited_s)
            decision, branches = await self.decide(req, requirement, shape, who)
            info = branches[0].engine.info
            if info is not None:  # a model's branches share one vocabulary
                check_vocabulary(req, info.n_vocab)
            trace.routed(decision)
            prompt = None
            if isinstance(req, ChatCompletionRequest):
                limits = self._settings.limits
                template = info.chat_template if info else None
                messages, tools = template_messages(
                    [m.for_template() for m in req.messages], req.active_tools, template=template
                )
                prompt = await render_chat_bounded(  # off the loop, within a time and size
                    messages,
                    tools=tools,
                    model_template=template,
                    bos_token=info.bos_token if info else "",
                    eos_token=info.eos_token if info else "",
                    timeout_s=limits.template_timeout_s,
                    max_chars=limits.template_max_chars,
                    max_bytes=limits.template_max_bytes,
                    where=model,
                )
            job = build_job(
                req,
                decision,
                branches,
                prompt,
                max_tokens=self._settings.limits.max_tokens,
                deadline=deadline,
                grammar=grammar,
                tenant=tenant,
                ticket=ticket,
                trace=trace,
            )
            trace.bind(job.id)
        except BaseException:
            ticket.release()
            raise
        return job

    def abandon(self, job: Job, tokens: int = 0) -> None:
        """The job is over: give back its admission ticket and count its tokens."""
        self._runner.abandon(job, tokens)

    async def start(self, job: Job) -> Run:
        """Run ``job`` on the first branch of its decision that gets to its first token
        (:meth:`quantroute.api.runner.Runner.start`)."""
        with job.trace.failing():
            return await self._runner.start(job)

    # -- views and operator actions ----------------------------------------------

    def models(self, tenant: Tenant = OPEN) -> dict[str, Any]:
        """The body of ``GET /v1/models``: the models ``tenant`` may use."""
        return views.models_json(self._gateway, tenant)

    def model(self, model_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
        """The body of ``GET /v1/models/{id}``: a model, or a pinned branch (``model:branch``)."""
        return views.model_json(self._gateway, model_id, tenant)

    def devices(self) -> dict[str, Any]:
        """The body of ``GET /v1/devices``."""
        return views.devices_json(self._gateway)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``GET /readyz``: ready when every model has a branch that takes traffic."""
        return views.readiness_json(self._gateway)

    def metrics(self) -> bytes:
        """Prometheus text exposition: requests, routing, branches, devices."""
        return views.metrics_text(self._gateway)

    async def version(self) -> dict[str, Any]:
        """The body of ``GET /version``: quantroute's version and the llama.cpp build its
        workers load (probed once, in a child process: the gateway never loads llama.cpp)."""
        if self._build is None:  # one probe, however many ask at once
            self._build = asyncio.ensure_future(asyncio.to_thread(views.llama_build))
        return {"version": __version__, **await asyncio.shield(self._build)}

    def dashboard(self, everyone: bool = True) -> dict[str, Any]:
        """``GET /dashboard/data``: what the router did lately, for the status page; the
        list of last requests (ids, models, tokens of every tenant) only for ``everyone``."""
        data = self._gateway.observer.recent_json()
        if not everyone:
            data["recent"] = []
        return data

    def status(self) -> dict[str, Any]:
        """``GET /admin/status``: branch states, circuit breakers, the retry budget."""
        return views.status_json(self._gateway)

    async def reload(self) -> dict[str, Any]:
        """``POST /admin/reload``: validate, verify, start, swap, drain (``api.reload``)."""
        report = await self._gateway.reloader.reload("admin")
        return report.to_json()

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


def _limited(tenant: Tenant) -> Callable[[str], bool] | None:
    """The tenant's ``may_use`` when its key may not use every model (for ``lookup``)."""
    return None if "*" in tenant.models else tenant.may_use


def _prompt_text(req: ChatCompletionRequest | CompletionRequest) -> str:
    if isinstance(req, ChatCompletionRequest):
        return "\n".join(m.text for m in req.messages)
    return req.prompts[0]


_BUDGET_STEP_MS = 5.0  # the deadline left after the queue, rounded down to this


def _after_queue(requirement: Requirement, waited_s: float) -> Requirement:
    """``requirement`` with what its time in the admission queue left of its deadline:
    routing predicts a branch's time from the engine on (``routing/speeds.py``), so a
    request that waited must fit in less. Rounded down to a few milliseconds, so that
    requests that waited alike share the policy's ranking."""
    ms = requirement.deadline_ms
    if ms is None or waited_s <= 0.0:
        return requirement
    left = ms - 1000.0 * waited_s
    return replace(requirement, deadline_ms=max(0.0, left // _BUDGET_STEP_MS * _BUDGET_STEP_MS))

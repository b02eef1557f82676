"""The one service object the HTTP routes call: request → decision → engine run, and the
read-only views and operator actions around it.

``prepare`` turns a validated request into a :class:`Job` (prompts, sampling,
the routing decision); ``start`` runs it on the first branch that accepts
it, falling back to the next branch of the decision when one fails before
its first token; the returned :class:`Run` yields ``(choice index, event)``.
``explain``, ``models``, ``devices``, ``readiness`` and ``metrics`` report;
``set_pressure``, ``restart``, ``drain`` and ``undrain`` act (admin: ``api/operator.py``).
The composition root hands it the parts it uses (``api/gateway.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from quantroute import __version__
from quantroute.api import views
from quantroute.api.explain import explain_json, pinned_json
from quantroute.api.grammars import Grammars
from quantroute.api.jobs import Job, build_job, drafted
from quantroute.api.operator import Operator
from quantroute.api.run import Run
from quantroute.api.runner import Runner
from quantroute.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_limits,
    check_vocabulary,
)
from quantroute.api.tools import template_messages
from quantroute.config import LimitSettings, RoutingSettings
from quantroute.errors import RateLimitError, ServiceUnavailableError
from quantroute.observability import Observer, RequestTrace
from quantroute.resilience import Admission
from quantroute.resilience.tenants import OPEN, Limits, Tenant
from quantroute.routing.policy import Decision, choose, pinned
from quantroute.routing.records import RequestShape
from quantroute.routing.requirement import (
    DEADLINE_HEADER,
    QUALITY_HEADER,
    Requirement,
    parse_requirement,
)
from quantroute.routing.states import BranchStates
from quantroute.routing.table import Branch, ModelRoute, RouteTableRef, lookup
from quantroute.routing.versions import Audience
from quantroute.shaping.chat_template import render_chat_bounded

if TYPE_CHECKING:
    from quantroute.api.reload import ReloadReport

log = logging.getLogger(__name__)

Request = ChatCompletionRequest | CompletionRequest
_AFFINITY_PREFIX_CHARS = 256
_WAIT_POLL_S = 0.05


class Service:
    """What the routes may ask of the gateway; it never hands out the gateway's parts."""

    def __init__(
        self,
        routes: RouteTableRef,
        states: BranchStates,
        routable: Callable[[Branch], bool],
        admission: Admission,
        tenant_limits: Limits,
        observer: Observer,
        runner: Runner,
        views: views.ViewSources,
        reload: Callable[[str], Awaitable[ReloadReport]],
        *,
        routing: RoutingSettings,
        limits: LimitSettings,
        operator: Operator,
    ):
        self._routes = routes
        self._states = states
        self._routable = routable  # residency's: whether a branch takes routed traffic
        self._admission = admission
        self._tenant_limits = tenant_limits
        self._observer = observer
        self._runner = runner
        self._views = views
        self._reload = reload
        self._routing = routing
        self._limits = limits
        self._operator = operator  # the admin actions: pressure, restarts, drains
        self._grammars = Grammars(limits.compile_timeout_s)
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
        route, branch = lookup(self._routes.current, req.model, who)
        if branch is not None:
            ready = self._routable(branch)
            if not ready:  # drained by an operator: a 503 that says so
                self._operator.refuse_drained(branch)
            retry_s = self._routing.retry_after_s
            return pinned(route.name, branch.id, ready=ready, retry_after_s=retry_s), route
        states = self._states.read(route.name)
        return choose(route.name, requirement, shape, states, self._routing), route

    def _routing_inputs(
        self, req: Request, headers: Mapping[str, str]
    ) -> tuple[Requirement, RequestShape]:
        requirement = parse_requirement(
            req.quality,
            headers.get(QUALITY_HEADER),
            headers.get(DEADLINE_HEADER),
            req.timeout,
            self._routing,
        )
        text = _prompt_text(req)
        limit = req.limit
        ids = req.token_prompts if isinstance(req, CompletionRequest) else None
        shape = RequestShape(
            # an upper bound: a token is at least one byte of text
            prompt_tokens=max(map(len, ids)) if ids else len(text.encode()) + 1,
            max_tokens=limit or self._limits.max_tokens,
            prefix=text[:_AFFINITY_PREFIX_CHARS],
            drafted=drafted(req),
        )
        return requirement, shape

    def explain(
        self, req: Request, headers: Mapping[str, str], tenant: Tenant = OPEN
    ) -> dict[str, Any]:
        """The decision for ``req`` without running it: per branch, each filter and the score."""
        check_limits(req, self._limits)
        who = Audience.of(req.user, headers)
        route, branch = lookup(self._routes.current, req.model, who, _limited(tenant))
        requirement, shape = self._routing_inputs(req, headers)  # a bad header is a 400 here too
        if branch is not None:
            ready = self._routable(branch)
            return pinned_json(route.name, branch, ready=ready, settings=self._routing)
        states = self._states.read(route.name)
        return explain_json(route.name, requirement, shape, states, self._routing, route.branches)

    async def decide(
        self,
        req: Request,
        requirement: Requirement,
        shape: RequestShape,
        who: Audience | None = None,
    ) -> tuple[Decision, tuple[Branch, ...]]:
        """``route``, waiting where the tier says to wait (``exact``: for the reference)."""
        decision, route = self.route(req, requirement, shape, who)
        if decision.wait_s is not None:  # for the reference: none if an operator drained it
            self._operator.refuse_drained(route.branch(route.reference))
            wait_until = time.monotonic() + decision.wait_s
            while not decision.branch_ids:
                if time.monotonic() >= wait_until:
                    raise ServiceUnavailableError(
                        f"no branch of {decision.model} met the request's quality bound in time",
                        retry_after_s=self._routing.retry_after_s,
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
        trace = self._observer.begin(req, headers, tenant.name)
        with trace.failing():
            return await self._prepare(req, headers, tenant, trace)

    async def _prepare(
        self, req: Request, headers: Mapping[str, str], tenant: Tenant, trace: RequestTrace
    ) -> Job:
        check_limits(req, self._limits)  # cheap checks first, then the tenant's limits
        tenant_limits = self._tenant_limits
        who = Audience.of(req.user, headers)
        route, _ = lookup(self._routes.current, req.model, who, _limited(tenant))
        over, stamp = await tenant_limits.admit(tenant)  # checked and counted in one step
        if over is not None:
            limit, retry_s = over
            raise RateLimitError(
                f"this key is over its {limit.replace('_', ' ')} limit", retry_after_s=retry_s
            )
        try:  # what the client chose to cost: after the limits, off the loop, bounded
            grammar = await self._grammars.of(req, None if tenant is OPEN else tenant.name)
        except BaseException:
            tenant_limits.finished(tenant, 0)  # it ran: it counts in the tenant's minute
            raise
        try:
            return await self._admit(req, headers, tenant, route.name, trace, who, grammar)
        except BaseException:
            tenant_limits.withdrawn(tenant, stamp)
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
        # parsed here, for pinned requests too: a malformed header is a 400 either way, and
        # the deadline bounds the queue, the first token and the generation
        requirement, shape = self._routing_inputs(req, headers)
        ms = requirement.deadline_ms
        deadline = None if ms is None else time.monotonic() + ms / 1000.0
        ticket = await self._admission.enter(
            model,
            capacity=self._capacity(model),
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
            client: list[dict[str, Any]] | None = None  # the messages, for a remote's ChatInput
            if isinstance(req, ChatCompletionRequest):
                limits = self._limits
                template = info.chat_template if info else None
                client = [m.for_template() for m in req.messages]
                messages, tools = template_messages(client, req.active_tools, template=template)
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
                max_tokens=self._limits.max_tokens,
                deadline=deadline,
                grammar=grammar,
                tenant=tenant,
                ticket=ticket,
                trace=trace,
                messages=client,
            )
            trace.bind(job.id)
        except BaseException:
            ticket.release()
            raise
        return job

    def _capacity(self, model: str) -> int:
        """Requests of ``model`` that may run at once: its routable branches' slots."""
        route = self._routes.current.models.get(model)
        slots = 0
        for b in route.branches if route else ():
            if self._routable(b) and b.engine.info is not None:
                slots += b.engine.info.parallel
        return self._admission.capacity(slots)

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
        return views.models_json(self._views, tenant)

    def model(self, model_id: str, tenant: Tenant = OPEN) -> dict[str, Any]:
        """The body of ``GET /v1/models/{id}``: a model, or a pinned branch (``model:branch``)."""
        return views.model_json(self._views, model_id, tenant)

    def devices(self) -> dict[str, Any]:
        """The body of ``GET /v1/devices``."""
        return views.devices_json(self._views)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``GET /readyz``: ready when every model has a branch that takes traffic."""
        return views.readiness_json(self._views)

    def metrics(self) -> bytes:
        """Prometheus text exposition: requests, routing, branches, devices."""
        return views.metrics_text(self._views)

    async def version(self) -> dict[str, Any]:
        """The body of ``GET /version``: quantroute's version and the llama.cpp build its
        workers load (probed once, in a child process: the gateway never loads llama.cpp)."""
        if self._build is None:  # one probe, however many ask at once
            self._build = asyncio.ensure_future(asyncio.to_thread(views.llama_build))
        return {"version": __version__, **await asyncio.shield(self._build)}

    def dashboard(self, everyone: bool = True) -> dict[str, Any]:
        """``GET /dashboard/data``: what the router did lately, for the status page; the
        list of last requests (ids, models, tokens of every tenant) only for ``everyone``."""
        data = self._observer.recent_json()
        if not everyone:
            data["recent"] = []
        return data

    def status(self) -> dict[str, Any]:
        """``GET /admin/status``: branch states, circuit breakers, the retry budget."""
        return views.status_json(self._views)

    async def reload(self) -> dict[str, Any]:
        """``POST /admin/reload``: validate, verify, start, swap, drain (``api.reload``)."""
        report = await self._reload("admin")
        return report.to_json()

    def set_pressure(self, device_id: str, nbytes: int) -> None:
        """Simulated devices only: occupy ``nbytes`` of a device, as another tenant would."""
        self._operator.set_pressure(device_id, nbytes)

    async def restart(self, branch_ref: str) -> dict[str, Any]:
        """Restart a branch (``model:branch``), clearing its failure; the answer says how it
        came back."""
        return await self._operator.restart(branch_ref)

    async def drain(self, branch_ref: str) -> dict[str, Any]:
        """``POST /admin/branches/{id}/drain``: no new requests for the branch, on every
        gateway of the fleet (``cluster/``); those in flight finish."""
        return await self._operator.drain(branch_ref)

    async def undrain(self, branch_ref: str) -> dict[str, Any]:
        """``POST /admin/branches/{id}/undrain``: the branch takes requests again."""
        return await self._operator.undrain(branch_ref)


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

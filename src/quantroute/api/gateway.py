"""The composition root: builds the parts, starts them in order, stops them in reverse.

``Gateway`` owns one of each part and wires them together; the work is the
parts' own:

==========================  =================================================================
part                        what it does
==========================  =================================================================
``routes``                  the route table (models → branches → engines), swapped whole
``poller``                  reads the devices (``telemetry``); routing reads its snapshot
``occupancy``               where each branch lives and what it occupies (``telemetry``)
``residency``               loads and unloads branches as memory changes; which branches
                            take routed traffic (``routing``)
``states``                  the policy's view of every branch, built per request (``routing``)
``drift``                   replays sampled requests through the reference (``quality``)
``breakers``                one circuit breaker per branch; ``retry_budget`` (``resilience``)
``tenants``, ``limits``     client keys and each tenant's limits (``resilience.tenants``)
``admission``               the bounded, prioritised queue in front of each model
``catalog``, ``reloader``   route tables from the repository; hot reloads (``api.reload``)
``cluster``                 drains, traffic rules and tenants: etcd's, watched (``cluster``)
``operator``                the admin actions: pressure, restarts, drains (``api.operator``)
``runner``                  runs a job on its decision's branches (``api.runner``)
``service``                 the one object the HTTP routes call (``api.service``)
==========================  =================================================================

Each part is handed what it uses, never the ``Gateway``: a test builds one from plain data.

It also listens to the engines (:class:`~quantroute.engines.EngineListener`)
and passes what they say to the parts that care: a branch that becomes ready
is measured, one whose worker dies is detached from its device and counts
against its health, one that fails is logged with its cause. The lifespan owns one Gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any

from quantroute.api.catalog import Catalog, placement_request
from quantroute.api.operator import Operator
from quantroute.api.parts import breakers_from, drift_monitor, find_sim, gpu_offload, table_of
from quantroute.api.reload import Reloader, ReloadReport, Wiring
from quantroute.api.run import Run
from quantroute.api.runner import Runner, serves
from quantroute.api.service import Service
from quantroute.api.views import ViewSources
from quantroute.cluster import ClusterState
from quantroute.cluster.redis_fleet import RedisFleet
from quantroute.config import Settings
from quantroute.engines.base import Engine
from quantroute.engines.exits import crashed
from quantroute.observability import Observer
from quantroute.quality.drift import DriftMonitor, Replay
from quantroute.registry.watcher import watch_repository
from quantroute.resilience import Admission, RetryBudget, TenantLimits, load_tenants
from quantroute.routing.residency import Residency
from quantroute.routing.speeds import ObservedSpeeds, observe_finished
from quantroute.routing.states import BranchStates, RecentRate
from quantroute.routing.table import Branch, RouteTable, RouteTableRef
from quantroute.shaping.template_pool import close_default_pool
from quantroute.telemetry import DevicePoller, DeviceProvider
from quantroute.telemetry.occupancy import Occupancy
from quantroute.telemetry.selection import (
    health_from_settings,
    margin_from_settings,
    poller_from_settings,
    provider_from_settings,
)
from quantroute.telemetry.stats import DeviceKind
from quantroute.types import split_version

log = logging.getLogger(__name__)


def build_routes(settings: Settings) -> RouteTable:
    """One engine per branch of every model in the repository (not started)."""
    catalog = Catalog(settings)
    return table_of(catalog.build_all(catalog.scan()))


class Gateway:
    def __init__(
        self,
        settings: Settings,
        table: RouteTable | None = None,
        provider: DeviceProvider | None = None,
    ):
        self.settings = settings
        self._given_table = table
        self.fixed_table = table is not None  # given whole (tests): nothing to reload from
        self._provider = provider or provider_from_settings(settings.telemetry)
        self.routes = RouteTableRef(table or RouteTable())
        self.health = health_from_settings(settings.telemetry)
        self.margin = margin_from_settings(settings.telemetry)
        self.popularity = RecentRate()
        r = settings.resilience
        self.breakers = breakers_from(r)
        self.retry_budget = RetryBudget(ratio=r.retry_ratio, min_retries=r.retry_min)
        self.tenants = load_tenants(settings.auth.tenants_file)
        self.fleet = RedisFleet.of(settings)  # streams and limits shared over Redis
        self.limits = TenantLimits() if self.fleet is None else self.fleet.limits
        # admission.* is Admission's own keywords: queue_size, slots_factor, retry_after_s
        a = settings.admission.model_dump()
        self.admission = Admission(**a, in_flight_of=self.limits.in_flight)
        self.poller: DevicePoller = poller_from_settings(
            self._provider, settings.telemetry, health=self.health
        )
        e = settings.engine
        self.occupancy = Occupancy(
            self.poller,
            health=self.health,
            margin=self.margin,
            n_ctx=e.n_ctx,
            parallel=e.parallel,
            n_batch=e.n_batch,
            n_gpu_layers=e.n_gpu_layers,
            sim=find_sim(self._provider),
            sim_weight_scale=settings.telemetry.sim_weight_scale,
        )
        self.residency = Residency(
            self.routes,
            self.occupancy,
            self.poller,
            margin=self.margin,
            popularity=self.popularity,
            reload_margin_bytes=settings.routing.reload_margin_bytes,
        )
        self.cluster = ClusterState(  # drains, traffic rules, tenants: etcd's, or this one's
            settings.cluster, self.routes, self.residency.set_drained, self.tenants
        )
        self.drift = DriftMonitor(settings.drift, reference={}, scorers={}, baselines={})
        self.states = BranchStates(
            self.routes,
            lambda: self.poller.snapshot,
            lifecycle=self.residency,
            placements=self.occupancy,
            degraded=lambda branch_id: self.drift.degraded(branch_id),
            breakers=self.breakers,
            health=self.health,
            margin=self.margin,
            popularity=self.popularity,
            stale_free_cap_bytes=settings.routing.tight_free_bytes - 1,
            degraded_version=lambda: (self.drift, self.drift.version),
            speeds=ObservedSpeeds(
                settings.routing.speeds.weight, settings.routing.speeds.max_age_s
            ),
        )
        self.observer = Observer(
            settings.observability,
            device_of=self._device_of,
            served=lambda ref: self.routes.current.serves(ref),
        )
        self.catalog = Catalog(settings)
        self._branch_of: dict[int, Branch] = {}
        self.superseded: dict[str, str] = {}  # branch id -> why its worker stays down
        self.answered: Counter[str] = Counter()  # model@version -> requests it answered
        self._tasks: set[asyncio.Task[None]] = set()
        self.reloader = Reloader(
            self.routes,
            None if self.fixed_table else self.catalog,
            self.occupancy,
            Wiring(self.attach, self.detach, self.swap, self.forget, self.residency.start),
            superseded=self.superseded,
            repository=settings.repository,
        )
        self.reloader.hooks.append(self._count_reload)
        self.runner = Runner(
            self.routes,
            self.breakers,
            self.retry_budget,
            self.limits,
            first_token_timeout_s=r.first_token_timeout_s,
            retry_after_s=settings.routing.retry_after_s,
            finished=self.finished,
        )
        self.service = Service(
            self.routes,
            self.states,
            self.residency.routable,
            self.admission,
            self.limits,
            self.observer,
            self.runner,
            ViewSources(
                routes=self.routes,
                occupancy=self.occupancy,
                residency=self.residency,
                speeds=self.states.speeds,
                drift=lambda: self.drift,
                breakers=self.breakers,
                retry_budget=self.retry_budget,
                admission=self.admission,
                poller=self.poller,
                health=self.health,
                margin=self.margin,
                observer=self.observer,
                superseded=self.superseded,
                answered=self.answered,
                repository=self.reloader.status,
                cluster=self.cluster,
                redis=lambda: None if self.fleet is None else self.fleet.status(),
            ),
            self.reloader.reload,
            routing=settings.routing,
            limits=settings.limits,
            operator=Operator(
                self.routes, self.cluster, settings.routing.retry_after_s, self.occupancy.sim
            ),
        )

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        await self.cluster.start()  # etcd's tenants, drains and rules before anything serves
        if self.fleet is not None:
            await self.fleet.start()
        if self.tenants.open:
            log.warning(
                "no client API keys are configured (auth.tenants_file): the API is open to "
                "anyone who can reach %s:%d",
                self.settings.server.host,
                self.settings.server.port,
            )
        else:
            log.info("tenants: %s", ", ".join(self.tenants.names()))
        await self.poller.poll_once()
        self.poller.start()
        table = self._given_table
        if table is None:
            scan = await asyncio.to_thread(self.catalog.scan)
            builds = self.catalog.build_all(scan)
            self.reloader.adopt(scan, builds)
            table = table_of(builds)
        self.routes.current = self.cluster.overlay(table)  # etcd's traffic rules, if any
        branches = table.branches()
        self._branch_of = {id(b.engine): b for b in branches}
        for branch in branches:
            branch.engine.listen(self)
        if any(d.kind is DeviceKind.CUDA for d in self.poller.snapshot.devices):
            self.occupancy.gpu_offload = await gpu_offload()
        requests = [placement_request(b) for b in branches]
        await asyncio.to_thread(self.occupancy.place_all, requests)  # reads GGUF headers
        for branch in branches:
            placement = self.occupancy.get(branch.id)
            if placement is not None:
                branch.engine.offload(placement.offload)
        await self.residency.start(branches)
        self.drift = drift_monitor(self.settings.drift, table)
        self.drift.start()
        if self.settings.routing.residency:
            self._spawn(self.residency.run(self.settings.telemetry.poll_interval_s))
        r = self.settings.repository
        if r.watch and self._given_table is None:
            self._spawn(watch_repository(self.settings.repo, self._watched, r.watch_debounce_ms))
        self.observer.start()
        log.info("serving %s", ", ".join(b.id for b in branches if b.engine.ready) or "nothing")
        for b in branches:
            placement = self.occupancy.get(b.id)
            why = b.engine.failure or (placement.problem if placement else None)
            if why:
                log.error("%s: failed: %s", b.id, why)

    async def stop(self) -> None:
        await self.drift.stop()
        for task in self._tasks:
            task.cancel()
        await self.reloader.stop()
        for branch in reversed(self.routes.current.branches()):
            await branch.engine.stop()
        await self.poller.stop()
        await asyncio.to_thread(close_default_pool)  # the chat templates' render processes
        self._provider.close()
        await self.cluster.stop()  # the watch
        if self.fleet is not None:
            await self.fleet.stop()  # after the stream store closed (api/app.py)
        self.observer.shutdown()  # last: the spans of the requests that just ended

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reloads (api.reload decides; these wire the parts) ----------------------

    async def _watched(self, trigger: str) -> None:  # the watcher does not wait for drains
        await self.reloader.reload(trigger, wait=False)

    def attach(self, branches: Sequence[Branch]) -> None:
        """New branches (not yet serving): the gateway hears their engines."""
        for b in branches:
            self._branch_of[id(b.engine)] = b
            b.engine.listen(self)

    def detach(self, branches: Sequence[Branch]) -> None:
        """Branches leaving: their engines' events no longer reach the parts (a replaced
        branch's id is the new one's, whose placement they must not touch)."""
        for b in branches:
            self._branch_of.pop(id(b.engine), None)

    def swap(self, table: RouteTable, retired: Sequence[Branch]) -> None:
        """Serve ``table`` from now on; ``retired`` branches drain (``api.reload``). A
        branch id that gets a new worker gets a fresh circuit breaker and speed too."""
        self.detach(retired)
        for b in retired:
            self.breakers.reset(b.id)
            self.states.speeds.forget(b.id)  # and its speed is learned afresh
        for b in table.branches():
            self._branch_of[id(b.engine)] = b  # the same engine may have a fresh Branch
            if b.engine.ready:
                self.superseded.pop(b.id, None)
        previous = self.routes.current
        self.routes.current = self.cluster.overlay(table)  # one assignment: old or new
        old = self.drift
        self.drift = drift_monitor(self.settings.drift, table)
        engines = {b.id: b.engine for b in previous.branches()}
        self.drift.adopt(old, [b.id for b in table.branches() if engines.get(b.id) is b.engine])
        self.drift.start()
        self._spawn(old.stop())

    def serves(self, branch: Branch) -> bool:
        """Whether ``branch``'s worker is the one the route table serves its id with now
        (a reload may have replaced it; the replaced one drains)."""
        return serves(self.routes.current, branch)

    def forget(self, branch_id: str) -> None:
        """A branch id no longer in the table: its placement and residency go."""
        self.occupancy.unloaded(branch_id)
        self.occupancy.restore(branch_id, None)
        self.residency.forget(branch_id)

    # -- what the service reports back ----------------------------------------

    def _device_of(self, branch_id: str) -> str | None:
        placement = self.occupancy.get(branch_id)
        return placement.device if placement is not None else None

    def _count_reload(self, report: ReloadReport) -> None:
        # "failed": some model kept its old version, which serves on (rejected, in metrics)
        outcome = {"swapped": "applied", "failed": "rejected"}.get(report.outcome)
        if outcome is not None:
            self.observer.hot_reload(outcome)

    def finished(self, run: Run, tokens: list[int]) -> None:
        """A request's first choice finished: count it, and offer it for drift replay."""
        self.popularity.record(run.branch.id)
        if self.serves(run.branch):  # a replaced worker's speed is not its successor's
            observe_finished(
                self.states.speeds, run.branch.id, run.job.trace, len(tokens), run.opened, run.held
            )
        version = run.branch.version
        if version is not None:  # answers by version: /admin/status and metrics
            self.answered[run.branch.model] += 1
            self.observer.version_answered(split_version(run.branch.model)[0], version)
        first = run.job.requests[0]
        if first.prompt_ids is None:  # a replay re-tokenizes the text: token prompts have none
            self.drift.offer(  # a remote's answer goes as text (no ids): run.text
                Replay(run.branch.id, first.prompt, tuple(tokens), first.parse_special, run.text)
            )

    # -- engine events (EngineListener) ---------------------------------------

    def engine_ready(self, engine: Engine) -> None:
        branch = self._branch_of.get(id(engine))
        if branch is None:
            return
        self.occupancy.loaded(branch.id)
        self._spawn(self.occupancy.measure(branch.id, engine.pid))

    def engine_exited(self, engine: Engine, returncode: int) -> None:
        branch = self._branch_of.get(id(engine))
        if branch is None:
            return
        self.occupancy.unloaded(branch.id, crashed=crashed(returncode) or returncode != 0)
        self.observer.worker_restarted(branch.model, branch.name)
        if branch.artifact.replaced():  # a restart would load a file nothing has checked
            why = (
                f"its worker stopped after {branch.artifact.path.name} was replaced on disk; "
                "it is not restarted on an unchecked file (a reload serves the new one)"
            )
            log.error("%s: %s", branch.id, why)
            self.superseded[branch.id] = why
            self._spawn(engine.stop())

    def engine_failed(self, engine: Engine, cause: str) -> None:
        branch = self._branch_of.get(id(engine))
        name = branch.id if branch is not None else engine.name
        log.error("%s: branch failed: %s; routing skips it until it is restarted", name, cause)

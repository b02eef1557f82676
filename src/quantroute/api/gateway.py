"""The composition root: branches, their engines, the devices they live on.

``Gateway`` builds one engine per branch of the repository, reads the devices
(``telemetry``), places each branch on a device by the memory model's
estimate, and keeps that accounting true as workers come and go: a worker that
becomes ready is measured (RSS after a warm-up) and its footprint corrected; a
simulated device's used memory moves with the branches loaded on it; a worker
that dies counts against its device's health. The lifespan owns one Gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from quantroute.api.service import CompletionService, Run
from quantroute.config import Settings
from quantroute.engines.base import GenerationRequest, SamplingParams
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import (
    DeviceOutOfMemoryError,
    InsufficientMemoryError,
    InvalidRequestError,
    NotFoundError,
)
from quantroute.quality.drift import Baseline, DriftMonitor, Replay
from quantroute.quality.profile import load_profiles
from quantroute.registry.repository import scan_repository
from quantroute.routing.residency import ResidencyPlan, ResidentBranch, plan_residency
from quantroute.routing.scoring import BranchState
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef
from quantroute.telemetry import (
    WORKER_RUNTIME_BYTES,
    DevicePoller,
    DeviceProvider,
    Footprint,
    HealthTracker,
    SimDeviceProvider,
    estimate_footprint,
    kv_cache_bytes,
    measure_process_rss,
    place,
    plan_cpu_affinity,
    read_model_shape,
)
from quantroute.telemetry.selection import (
    CompositeProvider,
    health_from_settings,
    margin_from_settings,
    poller_from_settings,
    provider_from_settings,
)
from quantroute.telemetry.stats import DeviceKind, DeviceStats

log = logging.getLogger(__name__)

_HEAT_WINDOW_S = 60.0  # requests/s are averaged over about this long


@dataclass(frozen=True, slots=True)
class Placement:
    device: str | None  # None: no device had room; the branch is not started
    footprint: Footprint
    kv_bytes_per_token: int = 0  # what one more token of context costs the device


def default_threads(n_workers: int, cores: int | None = None) -> int:
    """Threads per worker when not configured: the cores split among the workers,
    one core left to the gateway. llama.cpp's threads spin while they wait, so
    workers that together ask for more threads than there are cores slow each
    other down by an order of magnitude on a small host."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, (cores - 1) // max(n_workers, 1))


def find_sim(provider: DeviceProvider) -> SimDeviceProvider | None:
    if isinstance(provider, SimDeviceProvider):
        return provider
    if isinstance(provider, CompositeProvider):
        return next((p for p in provider.providers if isinstance(p, SimDeviceProvider)), None)
    return None


class Gateway:
    def __init__(
        self,
        settings: Settings,
        table: RouteTable | None = None,
        provider: DeviceProvider | None = None,
    ):
        self.settings = settings
        self._given_table = table
        self._provider = provider
        self.routes = RouteTableRef(table or RouteTable())
        self.service = CompletionService(
            self.routes,
            settings,
            degraded=self._degraded,
            on_finished=self._finished,
            states=self.branch_states,
            admit=self.admit,
        )
        self.drift: DriftMonitor | None = None
        self.health: HealthTracker = health_from_settings(settings.telemetry)
        self.margin = margin_from_settings(settings.telemetry)
        self.poller: DevicePoller | None = None
        self.sim: SimDeviceProvider | None = None
        self.placements: dict[str, Placement] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loaded: set[str] = set()  # branches whose worker runs (or starts)
        self._warm: set[str] = set()  # loaded and warmed up: these take routed traffic
        self._warmed = asyncio.Event()  # set whenever a branch finishes its warm-up
        self._draining: set[str] = set()  # to unload once their requests finish
        self._heat: dict[str, tuple[float, float]] = {}  # id -> (requests/s EWMA, last use)

    # -- building -------------------------------------------------------------

    def build_routes(self) -> RouteTable:
        """One llama.cpp engine per branch of every model in the repository (not started)."""
        settings, e = self.settings, self.settings.engine
        scan = scan_repository(settings.repo)
        n_workers = sum(len(m.artifacts) for m in scan.models)
        pinning = (
            plan_cpu_affinity(n_workers, pinned=settings.telemetry.cpu_affinity)
            if (e.pin_cpus or settings.telemetry.cpu_affinity) and n_workers
            else None
        )
        policy = RestartPolicy(
            backoff_s=e.restart_backoff_s,
            backoff_max_s=e.restart_backoff_max_s,
            stop_grace_s=e.cancel_grace_s,
        )
        routes, index = [], 0
        for model in scan.models:
            profiles, warnings = load_profiles(model.directory, model.artifacts)
            for warning in warnings:
                log.warning("profile: %s", warning)
            branches = []
            for a in model.artifacts:
                cpus = tuple(sorted(pinning[index])) if pinning else ()
                index += 1
                threads = e.n_threads or (len(cpus) if cpus else default_threads(n_workers))
                options = WorkerOptions(
                    n_ctx=e.n_ctx,
                    parallel=e.parallel,
                    n_threads=threads,
                    n_batch=e.n_batch,
                    log_level=settings.server.log_level,
                    start_timeout_s=e.start_timeout_s,
                    cpus=cpus,
                )
                engine = LlamaCppEngine(
                    f"{a.model}:{a.name}", a.path, options, policy, listener=self
                )
                branches.append(Branch(a.model, a.name, a.precision, a, engine, profiles[a.name]))
            routes.append(
                ModelRoute(
                    model.manifest.model,
                    model.manifest.reference,
                    tuple(branches),
                    tuple(warnings),
                )
            )
        return RouteTable.build(routes)

    def _estimate(self, branch: Branch) -> tuple[Footprint, int]:
        """The branch's footprint and its KV cost per token of context."""
        if not isinstance(branch.engine, LlamaCppEngine):
            return Footprint(branch.artifact.size_bytes, 0, 0, 0), 0
        shape = read_model_shape(branch.artifact.path)
        n_ctx = self.settings.engine.n_ctx or shape.n_ctx_train
        footprint = estimate_footprint(
            shape,
            n_ctx,
            n_parallel=self.settings.engine.parallel,
            n_batch=self.settings.engine.n_batch,
            runtime_bytes=WORKER_RUNTIME_BYTES,
        )
        return footprint, kv_cache_bytes(shape, 1)

    def device_bytes(self, footprint: Footprint) -> int:
        """What a branch occupies on its device: its footprint, with the weights scaled by
        ``telemetry.sim_weight_scale`` on simulated devices."""
        scale = self.settings.telemetry.sim_weight_scale
        if self.sim is None or scale == 1.0:
            return footprint.bytes
        return footprint.bytes + round(footprint.weights_bytes * (scale - 1.0))

    def admit(self, branch: Branch) -> None:
        """Before a request opens on ``branch``: on a simulated device over its budget,
        fail as the allocation on a real one would (the service falls back)."""
        placement = self.placements.get(branch.id)
        if self.sim is None or self.poller is None or placement is None or not placement.device:
            return
        device = self.poller.snapshot.device(placement.device)
        if device is not None and self.margin.balance(device) < 0:
            raise DeviceOutOfMemoryError(
                f"device {placement.device} is out of memory for branch {branch.id}"
            )

    def _place_all(self, branches: list[Branch]) -> None:
        snapshot = self.poller.snapshot if self.poller else None
        devices = list(snapshot.devices) if snapshot else []
        topology = snapshot.topology if snapshot else None
        kinds = (
            {DeviceKind.SIM} if any(d.kind is DeviceKind.SIM for d in devices) else {DeviceKind.CPU}
        )
        for branch in branches:
            footprint, kv_per_token = self._estimate(branch)
            device: str | None = None
            if devices and topology is not None:
                try:
                    device = place(
                        self.device_bytes(footprint),
                        devices,
                        topology,
                        self.health.factors(d.id for d in devices),
                        kinds=kinds,
                        margin=self.margin,
                    )[0]
                except InsufficientMemoryError as exc:
                    log.error("%s: not started: %s", branch.id, exc.message)
                need = self.device_bytes(footprint)
                devices = [_reserve(d, need) if d.id == device else d for d in devices]
            else:
                device = "cpu"
            self.placements[branch.id] = Placement(device, footprint, kv_per_token)

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        provider = self._provider or provider_from_settings(self.settings.telemetry)
        self._provider = provider
        self.sim = find_sim(provider)
        self.poller = poller_from_settings(provider, self.settings.telemetry, health=self.health)
        await self.poller.poll_once()
        self.poller.start()
        table = self._given_table
        if table is None:
            table = await asyncio.to_thread(self.build_routes)
        self.routes.current = table
        for branch in table.branches():  # engines of a given table report to us too
            if isinstance(branch.engine, LlamaCppEngine) and branch.engine.listener is None:
                branch.engine.listener = self
        self._place_all(table.branches())
        startable = [b for b in table.branches() if self.placements[b.id].device]
        self._loaded.update(b.id for b in startable)
        await asyncio.gather(*(b.engine.start() for b in startable))
        await self._until_warm(startable, timeout_s=self.settings.engine.start_timeout_s)
        self.drift = self._drift_monitor(table)
        self.drift.start()
        if self.settings.routing.residency:
            self._spawn(self._residency_loop())
        log.info("serving %s", ", ".join(b.id for b in table.branches() if b.engine.ready))

    async def stop(self) -> None:
        if self.drift is not None:
            await self.drift.stop()
        for task in self._tasks:
            task.cancel()
        for branch in reversed(self.routes.current.branches()):
            await branch.engine.stop()
        if self.poller is not None:
            await self.poller.stop()
        if self._provider is not None:
            self._provider.close()

    # -- quality drift --------------------------------------------------------

    def _drift_monitor(self, table: RouteTable) -> DriftMonitor:
        scorers = {b.id: b.engine for b in table.branches() if isinstance(b.engine, LlamaCppEngine)}
        reference = {
            b.id: f"{route.name}:{route.reference}"
            for route in table.models.values()
            for b in route.branches
            if b.id in scorers
        }
        baselines = {
            b.id: Baseline(b.profile.mean_kld, b.profile.top1)
            for b in table.branches()
            if b.profile is not None
        }
        return DriftMonitor(
            self.settings.drift, reference=reference, scorers=scorers, baselines=baselines
        )

    def _degraded(self, branch_id: str) -> bool:
        return self.drift is not None and self.drift.degraded(branch_id)

    def _finished(self, run: Run, tokens: list[int]) -> None:
        now = time.monotonic()
        self._heat[run.branch.id] = (
            self._recent_rate(run.branch.id, now) + 1 / _HEAT_WINDOW_S,
            now,
        )
        if self.drift is not None:
            first = run.job.requests[0]
            self.drift.offer(
                Replay(run.branch.id, first.prompt, tuple(tokens), first.parse_special)
            )

    # -- worker events (WorkerListener) ---------------------------------------

    def worker_ready(self, engine: LlamaCppEngine, pid: int) -> None:
        placement = self.placements.get(engine.name)
        if placement is None or placement.device is None:
            return
        if self.sim is not None:
            self.sim.attach(placement.device, engine.name, self.device_bytes(placement.footprint))
        self._spawn(self._measure(engine, pid))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def worker_exited(self, engine: LlamaCppEngine, returncode: int) -> None:
        self._warm.discard(engine.name)
        placement = self.placements.get(engine.name)
        if placement is None or placement.device is None:
            return
        if self.sim is not None:
            self.sim.detach(placement.device, engine.name)
        self.health.record_failure(placement.device, "worker_exit")

    async def _measure(self, engine: LlamaCppEngine, pid: int) -> None:
        """Warm the worker up (a prompt of one batch), then read its RSS. The branch
        takes routed traffic from then on."""
        try:
            await self._warm_up_and_measure(engine, pid)
        finally:
            if engine.ready:
                self._warm.add(engine.name)
            self._warmed.set()

    async def _until_warm(self, branches: Sequence[Branch], timeout_s: float) -> None:
        def cold() -> bool:
            return any(
                b.engine.ready and b.id not in self._warm
                for b in branches
                if isinstance(b.engine, LlamaCppEngine)
            )

        deadline = time.monotonic() + timeout_s
        while cold() and (left := deadline - time.monotonic()) > 0:
            self._warmed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._warmed.wait(), left)

    async def _warm_up_and_measure(self, engine: LlamaCppEngine, pid: int) -> None:
        info = engine.info
        if info is None:
            return
        warmup = GenerationRequest(
            "warmup",
            "x" * min(info.n_ctx - 2, self.settings.engine.n_batch - 1),
            SamplingParams(max_tokens=1, temperature=0.0),
        )
        try:
            async for _ in engine.generate(warmup):
                pass
            measured = measure_process_rss(pid)
        except Exception as exc:  # a warm-up that fails leaves the estimate standing
            log.warning("%s: footprint not measured: %s", engine.name, exc)
            return
        placement = self.placements[engine.name]
        footprint = placement.footprint.with_measurement(measured)
        self.placements[engine.name] = dataclasses.replace(placement, footprint=footprint)
        if self.sim is not None and placement.device is not None:
            self.sim.attach(placement.device, engine.name, self.device_bytes(footprint))
        log.info(
            "%s: footprint %d MiB measured, %d MiB estimated",
            engine.name,
            footprint.bytes >> 20,
            footprint.estimated_bytes >> 20,
        )

    # -- residency -------------------------------------------------------------

    async def _residency_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.telemetry.poll_interval_s)
            try:
                await self.apply_residency()
            except Exception:  # the loop must outlive any one bad reading
                log.exception("residency: planning failed")

    async def apply_residency(self) -> ResidencyPlan:
        """One round: plan from the latest device reading, then carry the plan out.
        A branch to unload first drains (no new traffic), then stops."""
        assert self.poller is not None
        snapshot = self.poller.snapshot
        if snapshot.stale or not snapshot.devices:
            return ResidencyPlan()  # no trustworthy reading: change nothing
        headroom = {d.id: self.margin.balance(d) for d in snapshot.devices}
        roomiest = max(headroom, key=lambda d: headroom[d])
        now = time.monotonic()
        residents, branches = [], {}
        for b in self.routes.current.branches():
            if not isinstance(b.engine, LlamaCppEngine):
                continue
            placement = self.placements[b.id]
            last = self._heat.get(b.id, (0.0, 0.0))[1]
            residents.append(
                ResidentBranch(
                    id=b.id,
                    model=b.model,
                    device=placement.device or roomiest,
                    footprint_bytes=self.device_bytes(placement.footprint),
                    loaded=b.id in self._loaded and b.id not in self._draining,
                    rank=b.precision.spec.rank,
                    heat=self._recent_rate(b.id, now),
                    last_used=last,
                )
            )
            branches[b.id] = b
        plan = plan_residency(
            residents, headroom, reload_margin_bytes=self.settings.routing.reload_margin_bytes
        )
        self._draining.update(plan.unload)
        for branch_id in list(self._draining):
            branch = branches[branch_id]
            if branch.engine.in_flight == 0:
                await self._unload(branch)
        for branch_id in plan.load:
            await self._load(
                branches[branch_id], device=next(r.device for r in residents if r.id == branch_id)
            )
        if plan:  # routing and admission should see the devices as they now are
            await self.poller.poll_once()
        return plan

    async def _unload(self, branch: Branch) -> None:
        self._draining.discard(branch.id)
        self._warm.discard(branch.id)
        self._loaded.discard(branch.id)
        await branch.engine.stop()
        device = self.placements[branch.id].device
        if self.sim is not None and device is not None:
            self.sim.detach(device, branch.id)
        log.warning("residency: unloaded %s from %s (memory)", branch.id, device)

    async def _load(self, branch: Branch, device: str) -> None:
        self.placements[branch.id] = dataclasses.replace(self.placements[branch.id], device=device)
        self._loaded.add(branch.id)
        log.info("residency: loading %s on %s", branch.id, device)
        await branch.engine.start()

    def routable(self, branch: Branch) -> bool:
        """Takes routed traffic: ready, warmed up, not draining."""
        if branch.id in self._draining or not branch.engine.ready:
            return False
        return branch.id in self._warm or not isinstance(branch.engine, LlamaCppEngine)

    # -- routing ----------------------------------------------------------------

    def branch_states(self, model: str) -> tuple[BranchState, ...]:
        """What the routing policy needs to know about every branch of ``model``, now.
        Reads the route table and the device snapshot once each (both immutable)."""
        route = self.routes.current.models.get(model)
        if route is None:
            return ()
        snapshot = self.poller.snapshot if self.poller is not None else None
        states = []
        for b in route.branches:
            placement = self.placements.get(b.id)
            device_id = placement.device if placement and placement.device else "cpu"
            device = snapshot.device(device_id) if snapshot is not None else None
            info = b.engine.info
            parallel = info.parallel if info is not None else 1
            profile = b.profile
            states.append(
                BranchState(
                    id=b.id,
                    model=b.model,
                    name=b.name,
                    precision=b.precision,
                    is_reference=b.name == route.reference,
                    ready=self.routable(b),
                    degraded=self._degraded(b.id),
                    mean_kld=profile.mean_kld if profile else None,
                    top1=profile.top1 if profile else None,
                    prefill_tps=profile.prefill_tps if profile else None,
                    decode_tps=profile.decode_tps if profile else None,
                    kv_bytes_per_token=placement.kv_bytes_per_token if placement else 0,
                    heat=0.0,
                    recent_rate=self._recent_rate(b.id),
                    device=device_id,
                    device_free_bytes=self.margin.headroom(device) if device else 0,
                    device_total_bytes=device.total_bytes if device else 0,
                    device_health=self.health.factor(device_id),
                    in_flight=b.engine.in_flight,
                    parallel=parallel,
                    queue_depth=max(0, b.engine.in_flight - parallel),
                )
            )
        return tuple(states)

    def _recent_rate(self, branch_id: str, now: float | None = None) -> float:
        """Requests per second routed to the branch lately (an exponential moving average)."""
        rate, last = self._heat.get(branch_id, (0.0, 0.0))
        if not last:
            return 0.0
        return rate * math.exp(-((now or time.monotonic()) - last) / _HEAT_WINDOW_S)

    # -- admin ----------------------------------------------------------------

    def set_pressure(self, device_id: str, nbytes: int) -> None:
        if self.sim is None:
            raise InvalidRequestError("pressure can only be set on simulated devices")
        if device_id not in self.sim.device_ids:
            raise NotFoundError("No such simulated device.", param="device_id", code="not_found")
        self.sim.set_pressure(device_id, nbytes)


def _reserve(device: DeviceStats, nbytes: int) -> DeviceStats:
    """The device as it will be once a branch of ``nbytes`` is loaded on it."""
    return dataclasses.replace(
        device,
        used_bytes=device.used_bytes + nbytes,
        free_bytes=max(device.free_bytes - nbytes, 0),
    )

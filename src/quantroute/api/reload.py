"""Hot reload of the model repository: verified, atomic, drained.

A reload (the repository watcher, or ``POST /admin/reload``) runs, per model:

1. **validate** — the manifest (schema), every file's GGUF header in a child
   process bounded in time and memory;
2. **verify** — every file's sha256 (streamed), the model's signature
   (``registry.signing``; required where ``repository.require_signatures``);
3. **start** new workers for the branches whose file or options changed (a
   branch whose fingerprint is the same keeps its worker), and **warm** them
   up (each engine's start does);
4. **swap** the route table reference: requests routed from now on go to the
   new branches; those already running keep their branch;
5. **drain** the replaced branches, in the background (``api.drain``) — wait
   until nothing has been in flight on them for ``repository.drain_quiet_s``
   (at most ``drain_timeout_s``) — and **stop** them, each exactly once.

A request routed before the swap that reaches its branch after it goes to the
branch's successor in the new table (``api.runner``); a branch id the new
table no longer has is tried on its old worker while that drains, and its
failure is a fallback that no circuit breaker counts.

A branch whose worker was stopped because its file was replaced on disk
(``superseded``, the composition root's) is never kept by a reload, even with the same
fingerprint: it gets a new, started worker. Every reload first asks each
running worker's engine whether the file it loaded is still the verified one
(``LlamaCppEngine.file_moved``: rewritten in place, its mtime set back or
not); one that moved is killed and not kept, and its restart refuses the
file, so a model whose new files are refused does not keep serving on bytes
nobody verified: that branch fails, in words, instead.

A model whose check or start fails keeps its old routes (the old version keeps
serving) and the failure is logged, counted by outcome and kept for
``GET /admin/status``. ``hooks`` are told every :class:`ReloadReport` (the
metrics hook: observability can count ``reloads_total{outcome}`` from it),
once its drain is over. Reloads run one at a time up to the swap; their drains
overlap.

The composition root hands a :class:`Reloader` what it uses: the route table's
reference, the catalog, the occupancy, a :class:`Wiring` of the root's own actions
(hear new engines, detach leaving ones, swap, forget an id), what it superseded, and
the repository settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantroute.api.catalog import Catalog, ModelBuild, local_workers, placement_request
from quantroute.api.drain import Drains
from quantroute.config import RepositorySettings
from quantroute.engines.llamacpp.engine import LlamaCppEngine
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef
from quantroute.routing.versions import VersionSplit
from quantroute.telemetry.occupancy import Occupancy

if TYPE_CHECKING:
    from quantroute.registry.repository import RepositoryScan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What one reload did. ``outcome``: ``swapped`` (a new table serves), ``unchanged``
    (nothing to do) or ``failed`` (at least one model kept its old version; others
    may have swapped, see ``swapped``)."""

    outcome: str
    trigger: str
    at: float  # wall clock, seconds
    generation: int  # the route table's, after the reload
    check_s: float  # validate + verify
    swap_s: float | None  # from the start to the swap (None: no swap)
    duration_s: float  # to the last replaced worker stopped
    swapped: tuple[str, ...] = ()  # routes with new workers, new or removed
    failures: dict[str, str] = field(default_factory=dict)  # model -> why it kept its old version
    drained: int = 0  # replaced branches stopped after their requests finished
    changed: tuple[str, ...] = ()  # routes and models changed with no new worker: rules, profiles

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Wiring:
    """What a reload asks of the parts around the table (the composition root's wiring)."""

    attach: Callable[[Sequence[Branch]], None]  # new branches: their engines are heard
    detach: Callable[[Sequence[Branch]], None]  # leaving: their events reach no part
    swap: Callable[[RouteTable, Sequence[Branch]], None]  # serve it; the branches drain
    forget: Callable[[str], None]  # an id no longer served: its placement, residency go
    start: Callable[[Sequence[Branch]], Awaitable[None]]  # residency's: start, warm up


class Reloader:
    """Reloads ``catalog``'s repository into ``routes`` (``None``: a table given whole,
    nothing to reload from); ``superseded``: the ids whose worker stays down."""

    def __init__(
        self,
        routes: RouteTableRef,
        catalog: Catalog | None,
        occupancy: Occupancy,
        wiring: Wiring,
        *,
        superseded: Mapping[str, str],
        repository: RepositorySettings,
    ):
        self._routes = routes
        self._catalog = catalog
        self._occupancy = occupancy
        self._wiring = wiring
        self._superseded = superseded
        self._lock = asyncio.Lock()
        self._stopped = False  # the gateway is stopping: no reload swaps any more
        self.fingerprints: dict[str, str] = {}  # branch id -> fingerprint of the serving one
        self._models_of: dict[Path, str] = {}  # model folder -> the model it serves
        self.counts: Counter[str] = Counter()  # reloads by outcome
        self.last: ReloadReport | None = None
        self._last_started = self._last_failure_started = float("-inf")  # monotonic
        self.last_failure: ReloadReport | None = None
        self.hooks: list[Callable[[ReloadReport], None]] = []
        self.drains = Drains(
            routes,
            wiring.forget,
            quiet_s=repository.drain_quiet_s,
            timeout_s=repository.drain_timeout_s,
            lock=self._lock,
        )

    def adopt(self, scan: RepositoryScan, builds: Sequence[ModelBuild]) -> None:
        """The first table's fingerprints and folders (the gateway's start)."""
        for build in builds:
            self.fingerprints.update(build.fingerprints)
        self._models_of = {m.directory: m.manifest.model for m in scan.models}

    def status(self) -> dict[str, Any]:
        """The repository part of ``GET /admin/status``."""
        return {
            "generation": self._routes.current.version,
            "reloads": {k: self.counts.get(k, 0) for k in ("swapped", "unchanged", "failed")},
            "last": self.last.to_json() if self.last else None,
            "last_failure": self.last_failure.to_json() if self.last_failure else None,
            "draining": [b.id for b in self.drains.branches],
        }

    async def reload(self, trigger: str = "admin", *, wait: bool = True) -> ReloadReport:
        """Reload the repository (see the module docstring); never raises for a bad model.
        The lock is held up to the swap; the drain runs after it, in the background.
        ``wait``: answer once the replaced workers are stopped (the admin endpoint) rather
        than at the swap (the watcher)."""
        async with self._lock:
            started = time.monotonic()
            try:
                catalog = self._catalog
                if catalog is None:
                    raise RuntimeError(
                        "this gateway serves a route table it was given, no repository"
                    )
                if self._stopped:  # its new workers would outlive the gateway's stop
                    raise RuntimeError("the gateway is stopping")
                report, retired = await self._reload(catalog, trigger, started)
            except Exception as exc:  # a bug or an unreadable repository: keep serving
                fixed = self._catalog is None
                log.error("reload (%s) failed: %s", trigger, exc, exc_info=not fixed)
                report, retired = (
                    ReloadReport(
                        "failed",
                        trigger,
                        time.time(),
                        self._routes.current.version,
                        time.monotonic() - started,
                        None,
                        time.monotonic() - started,
                        failures={"repository": f"{type(exc).__name__}: {exc}"},
                    ),
                    [],
                )
            if not retired:
                return self._record(report, started)
            drained = self.drains.spawn(self._drained(report, retired, started))
        return await asyncio.shield(drained) if wait else report

    async def _drained(
        self, report: ReloadReport, retired: list[Branch], started: float
    ) -> ReloadReport:
        drained = await self.drains.drain(retired)
        now = time.monotonic() - started
        report = replace(report, at=time.time(), duration_s=now, drained=drained)
        return self._record(report, started)

    def _record(self, report: ReloadReport, started: float) -> ReloadReport:
        """Count, keep, log and tell the hooks a finished reload. Drains overlap, so
        reloads may finish out of order: ``last`` is the latest to have started."""
        self.counts[report.outcome] += 1
        if started >= self._last_started:
            self.last, self._last_started = report, started
        if report.outcome == "failed":
            if started >= self._last_failure_started:
                self.last_failure, self._last_failure_started = report, started
            for model, why in report.failures.items():
                log.error("reload: %s keeps its old version: %s", model, why)
        elif report.outcome == "swapped":
            log.info(
                "reload: generation %d serves (%s) in %.3f s",
                report.generation,
                ", ".join(report.swapped + report.changed),
                report.swap_s or 0.0,
            )
        for hook in self.hooks:
            try:
                hook(report)
            except Exception:
                log.exception("reload hook failed")
        return report

    async def _reload(
        self, catalog: Catalog, trigger: str, started: float
    ) -> tuple[ReloadReport, list[Branch]]:
        scan = await asyncio.to_thread(catalog.scan)  # validate + verify, off the loop
        check_s = time.monotonic() - started
        current = self._routes.current
        failures: dict[str, str] = {}
        moved = _refuse_moved(current.branches())
        keep = {  # a worker stopped for a file replaced on disk is not kept: it gets a new one
            b.id: (self.fingerprints.get(b.id, ""), b.engine)
            for b in current.branches()
            if b.id not in self._superseded and b.id not in moved
        }
        n_workers = local_workers(scan)
        builds: list[ModelBuild] = []
        for entry in scan.models:
            bad = [a.problem for v in entry.versions for a in v if a.problem and a.url is None]
            if bad:
                failures[entry.manifest.model] = "; ".join(p for p in bad if p)
            else:
                builds.append(catalog.build(entry, keep, n_workers))
        for directory, problem in zip(scan.failed, scan.problems, strict=True):
            failures[self._models_of.get(directory, directory.name)] = problem

        fresh = [b for build in builds for b in build.new_branches]
        builds = await self._start(builds, fresh, failures)
        try:
            return await self._swap(trigger, started, check_s, scan, builds, fresh, failures)
        except BaseException:  # a bug, or the gateway stopping: no started worker is left over
            serving = {id(b.engine) for b in self._routes.current.branches()}
            left = [b.engine for b in fresh if id(b.engine) not in serving]
            await asyncio.shield(asyncio.gather(*(e.stop() for e in left), return_exceptions=True))
            raise

    async def _swap(
        self,
        trigger: str,
        started: float,
        check_s: float,
        scan: RepositoryScan,
        builds: list[ModelBuild],
        fresh: list[Branch],
        failures: dict[str, str],
    ) -> tuple[ReloadReport, list[Branch]]:
        """Swap in the new table; the report at the swap, and the branches to drain."""
        current = self._routes.current

        routes: list[ModelRoute] = []
        splits: list[VersionSplit] = []
        fingerprints: dict[str, str] = {}
        for build in builds:
            routes += build.routes
            splits += [build.split] if build.split else []
            fingerprints.update(build.fingerprints)
        built = {b.model for b in builds}
        for route in current.models.values():  # a failed model keeps its old routes
            if route.model in failures and route.model not in built:
                routes.append(route)
                for b in route.branches:
                    fingerprints[b.id] = self.fingerprints.get(b.id, "")
        splits += [s for m, s in current.splits.items() if m in failures and m not in built]

        serving = {id(b.engine) for r in routes for b in r.branches}
        retired = [b for b in current.branches() if id(b.engine) not in serving]
        swapped = sorted(
            {b.model for b in fresh if id(b.engine) in serving} | {b.model for b in retired}
        )
        table = RouteTable.build(routes, current.version + 1, splits)
        before, after = _views(current), _views(table)
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        if not swapped and not changed:
            outcome = "failed" if failures else "unchanged"
            now = time.monotonic() - started
            report = ReloadReport(
                outcome, trigger, time.time(), current.version, check_s, None, now, (), failures
            )
            return report, []
        self._wiring.swap(table, retired)
        swap_s = time.monotonic() - started
        self.fingerprints = fingerprints
        self._models_of = {
            m.directory: m.manifest.model for m in scan.models if m.manifest.model in built
        } | {d: m for d, m in self._models_of.items() if m in failures and m not in built}
        report = ReloadReport(
            "failed" if failures else "swapped",
            trigger,
            time.time(),
            table.version,
            check_s,
            swap_s,
            time.monotonic() - started,
            tuple(swapped),
            failures,
            changed=tuple(n for n in changed if n not in swapped),
        )
        return report, retired

    async def _start(
        self, builds: list[ModelBuild], fresh: list[Branch], failures: dict[str, str]
    ) -> list[ModelBuild]:
        """Place and start (with warm-up) the new branches; the builds whose new branches
        all came up. A build with one that did not is failed, its new workers stopped and
        the placements of the branches it would have replaced put back."""
        if not fresh:
            return builds
        occupancy, wiring = self._occupancy, self._wiring
        before = {b.id: occupancy.get(b.id) for b in fresh}
        requests = [placement_request(b) for b in fresh]
        await asyncio.to_thread(occupancy.place_all, requests)
        for b in fresh:
            placement = occupancy.get(b.id)
            if placement is not None:
                b.engine.offload(placement.offload)
        wiring.attach(fresh)
        await wiring.start(fresh)
        ok: list[ModelBuild] = []
        for build in builds:
            down = [
                b for b in build.new_branches if b.artifact.problem is None and not b.engine.ready
            ]
            if not down:
                ok.append(build)
                continue
            failures[build.model] = "; ".join(
                f"{b.id}: {b.engine.failure or 'did not become ready'}" for b in down
            )
            wiring.detach(build.new_branches)
            for b in build.new_branches:
                await b.engine.stop()
                occupancy.restore(b.id, before.get(b.id))
        return ok

    async def stop(self) -> None:
        """Stop the workers still draining (the gateway is stopping); a reload under way
        finishes its swap first, and none starts after."""
        async with self._lock:
            self._stopped = True
        await self.drains.close()


def _refuse_moved(branches: Sequence[Branch]) -> set[str]:
    """The branches whose running worker loaded a file that changed since (rewritten in
    place): each is killed, and its restart refuses the file (``registry.verified``)."""
    moved: set[str] = set()
    for b in branches:
        engine = b.engine
        why = engine.file_moved() if isinstance(engine, LlamaCppEngine) else None
        if why is not None and isinstance(engine, LlamaCppEngine):
            engine.refuse(why)
            moved.add(b.id)
    return moved


def _views(table: RouteTable) -> dict[str, list[object]]:
    """What a client or the policy can see of a table, per route (its branches, workers
    and profiles) and per model (its traffic split): two tables with the same views need
    no swap, and a name whose view changed is one the reload changed."""
    views: dict[str, list[object]] = {}
    for name, r in table.models.items():
        branches = tuple((b.name, id(b.engine), b.profile) for b in r.branches)
        views.setdefault(name, []).append((r.reference, branches, r.profile_warnings, r.stale))
    for m, split in table.splits.items():
        views.setdefault(m, []).append((split.default, split.rules, split.versions))
    return views

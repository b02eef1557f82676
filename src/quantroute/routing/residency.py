"""Which branches should be loaded, as device memory changes.

:func:`plan_residency` is pure and table-tested; :class:`Residency` carries a
plan out once per device reading (drains, stops and starts engines) and is
the branches' lifecycle: which of them take routed traffic.

Rules, per device, in order:

1. **Never past the budget.** On a device whose free-for-routing memory is
   below zero, the loaded branches are kept in order of value (recent request
   rate, then recency; among the cold, the smaller first, so that more stay)
   as long as they fit in what the device can give its branches; the rest are
   unloaded. A model left with nothing
   keeps (or loads) its most faithful branch that still fits, else its
   smallest loaded one.
2. **Every model keeps a branch.** A model with nothing loaded gets its
   cheapest branch that fits.
3. **Reload when there is room.** An unloaded branch is loaded again when its
   device has its footprint plus ``reload_margin_bytes`` free (hysteresis, so a
   branch does not flap at the edge), the most faithful first, one per device
   per reading.

A branch that is loaded takes traffic only once its engine is ready (warmed
up), it is not draining, and an operator has not drained it
(``POST /admin/branches/{id}/drain``: :meth:`Residency.set_drained`, from the cluster
state). An operator's drain only stops new requests: the branch stays loaded, its
requests in flight finish, and undraining it lets traffic back at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quantroute.routing.states import RecentRate
    from quantroute.routing.table import Branch, RouteTableRef
    from quantroute.telemetry.occupancy import Occupancy
    from quantroute.telemetry.placement import MarginPolicy
    from quantroute.telemetry.poller import DevicePoller

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResidentBranch:
    id: str
    model: str
    device: str
    footprint_bytes: int
    loaded: bool  # running or starting
    rank: int  # precision rank: 0 is the most faithful
    recent_rate: float = 0.0  # requests per second lately (popularity)
    last_used: float = 0.0  # monotonic time of the last request; 0: never


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    unload: tuple[str, ...] = ()
    load: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def _size(b: ResidentBranch) -> tuple[int, int]:
    return (b.footprint_bytes, -b.rank)


def plan_residency(
    branches: Sequence[ResidentBranch],
    headroom: Mapping[str, int],  # device id -> free-for-routing bytes now
    *,
    reload_margin_bytes: int,
) -> ResidencyPlan:
    free = dict(headroom)
    loaded_per_model: dict[str, int] = {}
    for b in branches:
        if b.loaded:
            loaded_per_model[b.model] = loaded_per_model.get(b.model, 0) + 1
    unload: list[str] = []
    load: list[str] = []
    for device in sorted({b.device for b in branches if b.loaded}):  # rule 1
        if free.get(device, 0) >= 0:
            continue
        here = [b for b in branches if b.device == device]
        loaded = [b for b in here if b.loaded]
        room = free.get(device, 0) + sum(b.footprint_bytes for b in loaded)
        kept: list[ResidentBranch] = []
        # hot first; among the cold, small first: more branches stay loaded
        for b in sorted(loaded, key=lambda b: (-b.recent_rate, -b.last_used, b.footprint_bytes)):
            if b.footprint_bytes <= room:
                kept.append(b)
                room -= b.footprint_bytes
        for model in sorted({b.model for b in loaded} - {b.model for b in kept}):
            fitting = sorted(
                (b for b in here if b.model == model and b.footprint_bytes <= room),
                key=lambda b: (b.rank, b.footprint_bytes),
            )
            if fitting:
                chosen = fitting[0]
                room -= chosen.footprint_bytes
                if not chosen.loaded:
                    load.append(chosen.id)
                    loaded_per_model[model] += 1
            else:  # nothing fits: keep the smallest, and say so by failing its requests
                chosen = min((b for b in loaded if b.model == model), key=_size)
            kept.append(chosen)
        for b in loaded:
            if b not in kept:
                unload.append(b.id)
                loaded_per_model[b.model] -= 1
        free[device] = room
    for model in sorted({b.model for b in branches}):  # rule 2
        if loaded_per_model.get(model, 0):
            continue
        candidates = sorted(
            (b for b in branches if b.model == model and not b.loaded and b.id not in unload),
            key=lambda b: (b.footprint_bytes, b.rank),
        )
        for b in candidates:
            if free.get(b.device, 0) >= b.footprint_bytes:
                load.append(b.id)
                loaded_per_model[model] = 1
                free[b.device] -= b.footprint_bytes
                break
    devices_loading = {b.device for b in branches if b.id in load}
    for b in sorted(branches, key=lambda b: (b.rank, b.footprint_bytes)):  # rule 3
        if b.loaded or b.id in load or b.id in unload or b.device in devices_loading:
            continue
        if free.get(b.device, 0) >= b.footprint_bytes + reload_margin_bytes:
            load.append(b.id)
            devices_loading.add(b.device)
            free[b.device] -= b.footprint_bytes
    return ResidencyPlan(tuple(unload), tuple(load))


class Residency:
    """Carries out residency plans, and says which branches take routed traffic."""

    def __init__(
        self,
        routes: RouteTableRef,
        occupancy: Occupancy,
        poller: DevicePoller,
        *,
        margin: MarginPolicy,
        popularity: RecentRate,
        reload_margin_bytes: int,
    ):
        self._routes = routes
        self._occupancy = occupancy
        self._poller = poller
        self._margin = margin
        self._popularity = popularity
        self._reload_margin_bytes = reload_margin_bytes
        self._loaded: set[str] = set()  # branches whose engine runs (or starts)
        self._draining: set[str] = set()  # to unload once their requests finish
        self._drained: frozenset[str] = frozenset()  # an operator's: no new requests

    def routable(self, branch: Branch) -> bool:
        """Takes routed traffic: its engine is ready (warmed up), it is not draining, and
        no operator drained it."""
        return (
            branch.engine.ready
            and branch.id not in self._draining
            and branch.id not in self._drained
        )

    def drained(self, branch_id: str) -> bool:
        """Drained by an operator: it takes no new requests, routed or pinned."""
        return branch_id in self._drained

    def set_drained(self, branch_ids: frozenset[str]) -> None:
        """The branches operators have drained, all of them: one assignment, so routing
        sees the old set or the new. Ids not in the route table wait for their branch."""
        self._drained = branch_ids

    def loaded(self, branch_id: str) -> bool:
        return branch_id in self._loaded

    def draining(self, branch_id: str) -> bool:
        return branch_id in self._draining

    def forget(self, branch_id: str) -> None:
        """A branch that left the route table (a reload removed or replaced it)."""
        self._loaded.discard(branch_id)
        self._draining.discard(branch_id)

    async def start(self, branches: Sequence[Branch]) -> None:
        """Start the engines of every placed branch (a branch without a device stays down)."""
        startable = [b for b in branches if self._device(b.id) is not None]
        self._loaded.update(b.id for b in startable)
        await asyncio.gather(*(b.engine.start() for b in startable))

    async def run(self, interval_s: float) -> None:
        """One round per interval, for as long as the server runs."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.apply()
            except Exception:  # the loop must outlive any one bad reading
                log.exception("residency: planning failed")

    async def apply(self) -> ResidencyPlan:
        """One round: plan from the latest device reading, then carry the plan out.
        A branch to unload first drains (no new traffic), then stops."""
        snapshot = self._poller.snapshot
        if snapshot.stale or not snapshot.devices:
            return ResidencyPlan()  # no trustworthy reading: change nothing
        headroom = {d.id: self._margin.balance(d) for d in snapshot.devices}
        roomiest = max(headroom, key=lambda d: headroom[d])
        now = time.monotonic()
        residents, branches = [], {}
        for b in self._routes.current.branches():
            placement = self._occupancy.get(b.id)
            if b.engine.model_path is None or placement is None or placement.problem:
                continue  # costs no local memory, or can never load
            residents.append(
                ResidentBranch(
                    id=b.id,
                    model=b.model,
                    device=placement.device or roomiest,
                    footprint_bytes=self._occupancy.device_bytes(placement.footprint),
                    loaded=b.id in self._loaded and b.id not in self._draining,
                    rank=b.precision.spec.rank,
                    recent_rate=self._popularity.rate(b.id, now),
                    last_used=self._popularity.last_used(b.id),
                )
            )
            branches[b.id] = b
        plan = plan_residency(residents, headroom, reload_margin_bytes=self._reload_margin_bytes)
        self._draining.update(plan.unload)
        for branch_id in list(self._draining):
            branch = branches[branch_id]
            if branch.engine.in_flight == 0:
                await self._unload(branch)
        for branch_id in plan.load:
            device = next(r.device for r in residents if r.id == branch_id)
            await self._load(branches[branch_id], device)
        if plan:  # routing and admission should see the devices as they now are
            await self._poller.poll_once()
        return plan

    def _device(self, branch_id: str) -> str | None:
        placement = self._occupancy.get(branch_id)
        return placement.device if placement is not None else None

    async def _unload(self, branch: Branch) -> None:
        self._draining.discard(branch.id)
        self._loaded.discard(branch.id)
        await branch.engine.stop()
        self._occupancy.unloaded(branch.id)
        log.warning("residency: unloaded %s from %s (memory)", branch.id, self._device(branch.id))

    async def _load(self, branch: Branch, device: str) -> None:
        self._occupancy.move(branch.id, device)
        placement = self._occupancy.get(branch.id)
        if placement is not None:
            branch.engine.offload(placement.offload)
        self._loaded.add(branch.id)
        log.info("residency: loading %s on %s", branch.id, device)
        await branch.engine.start()

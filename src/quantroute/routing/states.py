"""Building the policy's input: one :class:`BranchState` per branch, now.

:class:`BranchStates` reads, once each per request, the route table and the
device snapshot (both immutable, swapped by reference), and from the parts
that hold live state: the branch lifecycle (:class:`Lifecycle`: which branches
take routed traffic), placements (:class:`PlacementView`), the drift
monitor's verdicts, the circuit breakers, device health, and request popularity
(:class:`RecentRate`). It decides nothing; the policy does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from quantroute.resilience.breaker import Breakers
from quantroute.routing.records import BranchState
from quantroute.routing.table import Branch, RouteTableRef
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.occupancy import Placement
from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import DeviceStats

__all__ = ["BranchStates", "Lifecycle", "PlacementView", "RecentRate", "thermal_pressure"]

RATE_WINDOW_S = 60.0  # requests/s are averaged over about this long
COOL_C = 70.0  # GPU temperature with no thermal pressure
THROTTLE_C = 90.0  # where GPUs begin to throttle: pressure 1


def thermal_pressure(device: DeviceStats | None) -> float:
    """0 (cool, or temperature unknown) to 1 (at the throttle point), linear between."""
    if device is None or device.temperature_c is None:
        return 0.0
    return min(1.0, max(0.0, (device.temperature_c - COOL_C) / (THROTTLE_C - COOL_C)))


class RecentRate:
    """Requests per second routed to each branch lately: an exponentially decaying average
    (popularity; the residency manager keeps popular branches, the score spreads load)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self._window_s = window_s
        self._rates: dict[str, tuple[float, float]] = {}  # id -> (rate at last use, last use)

    def record(self, branch_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._rates[branch_id] = (self.rate(branch_id, now) + 1 / self._window_s, now)

    def rate(self, branch_id: str, now: float | None = None) -> float:
        rate, last = self._rates.get(branch_id, (0.0, 0.0))
        if not last:
            return 0.0
        now = time.monotonic() if now is None else now
        return rate * math.exp(-(now - last) / self._window_s)

    def last_used(self, branch_id: str) -> float:
        """Monotonic time of the branch's last request; 0 if never."""
        return self._rates.get(branch_id, (0.0, 0.0))[1]


class Lifecycle(Protocol):
    """Which branches take routed traffic (loaded, warmed up, not draining, not failed)."""

    def routable(self, branch: Branch) -> bool: ...


class PlacementView(Protocol):
    def get(self, branch_id: str) -> Placement | None: ...


class BranchStates:
    """``read(model)``: every branch of ``model`` as the policy sees it now."""

    def __init__(
        self,
        routes: RouteTableRef,
        snapshot: Callable[[], DeviceSnapshot | None],
        *,
        lifecycle: Lifecycle,
        placements: PlacementView,
        degraded: Callable[[str], bool],
        breakers: Breakers,
        health: HealthTracker,
        margin: MarginPolicy,
        popularity: RecentRate,
        stale_free_cap_bytes: int | None = None,
    ):
        self._routes = routes
        self._snapshot = snapshot
        self._lifecycle = lifecycle
        self._placements = placements
        self._degraded = degraded
        self._breakers = breakers
        self._health = health
        self._margin = margin
        self._popularity = popularity
        # With a stale device reading, free memory counts as at most this (routing's tight
        # threshold): routing turns conservative — the cheapest branch that meets the
        # bound — never optimistic on a reading that may be long out of date.
        self._stale_free_cap_bytes = stale_free_cap_bytes
        # branch id -> (the inputs it was built from, its record): reused while they hold
        self._cache: dict[str, tuple[tuple[Any, ...], BranchState]] = {}

    def read(self, model: str) -> tuple[BranchState, ...]:
        """Cheap enough for every request: each device is read once per call, and a
        branch whose inputs did not change since the last call keeps its record (most of
        them: a request changes the load of one branch)."""
        route = self._routes.current.models.get(model)
        if route is None:
            return ()
        snapshot = self._snapshot()
        now = time.monotonic()
        cap = self._stale_free_cap_bytes
        stale = cap is not None and snapshot is not None and snapshot.is_stale(now)
        devices: dict[str, tuple[int, int, float, float]] = {}
        cache = self._cache
        states = []
        for b in route.branches:
            placement = self._placements.get(b.id)
            device_id = placement.device if placement and placement.device else "cpu"
            seen = devices.get(device_id)
            if seen is None:
                device = snapshot.device(device_id) if snapshot is not None else None
                free = _free(self._margin.headroom(device), cap, stale) if device else 0
                total = device.total_bytes if device else 0
                seen = (free, total, self._health.factor(device_id), thermal_pressure(device))
                devices[device_id] = seen
            info = b.engine.info
            parallel = info.parallel if info is not None else 1
            in_flight = b.engine.in_flight
            inputs = (
                b,  # a new route table's branch is a new object: its profile, its name
                placement,
                self._lifecycle.routable(b),
                self._breakers.is_open(b.id),
                self._degraded(b.id),
                seen,
                in_flight,
                parallel,
                # decays every instant: the record is rebuilt when it moved by 0.05 req/s
                round(self._popularity.rate(b.id, now), 1),
            )
            hit = cache.get(b.id)
            if hit is not None and hit[0] == inputs:
                states.append(hit[1])
                continue
            state = _state(route.reference, *inputs)
            cache[b.id] = (inputs, state)
            states.append(state)
        if len(cache) > 4 * len(route.branches) + 64:  # branches of replaced tables
            live = {b.id for r in self._routes.current.models.values() for b in r.branches}
            for key in [k for k in cache if k not in live]:
                del cache[key]
        return tuple(states)


def _state(
    reference: str,
    b: Branch,
    placement: Placement | None,
    ready: bool,
    breaker_open: bool,
    degraded: bool,
    device: tuple[int, int, float, float],
    in_flight: int,
    parallel: int,
    recent_rate: float,
) -> BranchState:
    profile = b.profile
    free, total, health, heat = device
    return BranchState(
        id=b.id,
        model=b.model,
        name=b.name,
        precision=b.precision,
        is_reference=b.name == reference,
        ready=ready,
        breaker_open=breaker_open,
        degraded=degraded,
        mean_kld=profile.mean_kld if profile else None,
        top1=profile.top1 if profile else None,
        prefill_tps=profile.prefill_tps if profile else None,
        decode_tps=profile.decode_tps if profile else None,
        kv_bytes_per_token=placement.kv_bytes_per_token if placement else 0,
        device=placement.device if placement and placement.device else "cpu",
        device_free_bytes=free,
        device_total_bytes=total,
        device_health=health,
        running=min(in_flight, parallel),
        queued=max(0, in_flight - parallel),
        parallel=parallel,
        recent_rate=recent_rate,
        heat=heat,
    )


def _free(headroom: int, cap: int | None, stale: bool) -> int:
    """Free-for-routing bytes, capped while the reading is stale."""
    return min(headroom, cap) if stale and cap is not None else headroom

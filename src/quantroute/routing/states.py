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
from typing import Protocol

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

    def read(self, model: str) -> tuple[BranchState, ...]:
        route = self._routes.current.models.get(model)
        if route is None:
            return ()
        snapshot = self._snapshot()
        now = time.monotonic()
        cap = self._stale_free_cap_bytes
        stale = cap is not None and snapshot is not None and snapshot.is_stale(now)
        states = []
        for b in route.branches:
            placement = self._placements.get(b.id)
            device_id = placement.device if placement and placement.device else "cpu"
            device = snapshot.device(device_id) if snapshot is not None else None
            info = b.engine.info
            parallel = info.parallel if info is not None else 1
            in_flight = b.engine.in_flight
            profile = b.profile
            states.append(
                BranchState(
                    id=b.id,
                    model=b.model,
                    name=b.name,
                    precision=b.precision,
                    is_reference=b.name == route.reference,
                    ready=self._lifecycle.routable(b),
                    breaker_open=self._breakers.is_open(b.id),
                    degraded=self._degraded(b.id),
                    mean_kld=profile.mean_kld if profile else None,
                    top1=profile.top1 if profile else None,
                    prefill_tps=profile.prefill_tps if profile else None,
                    decode_tps=profile.decode_tps if profile else None,
                    kv_bytes_per_token=placement.kv_bytes_per_token if placement else 0,
                    device=device_id,
                    device_free_bytes=_free(self._margin.headroom(device), cap, stale)
                    if device
                    else 0,
                    device_total_bytes=device.total_bytes if device else 0,
                    device_health=self._health.factor(device_id),
                    running=min(in_flight, parallel),
                    queued=max(0, in_flight - parallel),
                    parallel=parallel,
                    recent_rate=self._popularity.rate(b.id, now),
                    heat=thermal_pressure(device),
                )
            )
        return tuple(states)


def _free(headroom: int, cap: int | None, stale: bool) -> int:
    """Free-for-routing bytes, capped while the reading is stale."""
    return min(headroom, cap) if stale and cap is not None else headroom

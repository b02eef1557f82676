"""Building the policy's input: one :class:`BranchState` per branch, now.

:class:`BranchStates` reads, once each per request, the route table and the
device snapshot (both immutable, swapped by reference), and from the parts
that hold live state: the branch lifecycle (:class:`Lifecycle`: which branches
take routed traffic), placements (:class:`PlacementView`), the drift
monitor's verdicts, the circuit breakers, device health, and request popularity
(:class:`RecentRate`). It decides nothing; the policy does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol

from quantroute.engines.base import EngineInfo
from quantroute.resilience.breaker import Breakers
from quantroute.routing.records import BranchState
from quantroute.routing.speeds import ObservedSpeed, ObservedSpeeds
from quantroute.routing.table import Branch, ModelRoute, RouteTableRef
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.occupancy import Placement
from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import DeviceStats

__all__ = ["BranchStates", "Lifecycle", "PlacementView", "RecentRate", "thermal_pressure"]

RATE_WINDOW_S = 60.0  # requests/s are averaged over about this long
# A remote server's memory, for routing: its KV cache's free share of this many bytes
# (twice the default ample threshold: an empty cache is ample, a half-full one
# constrained, one over three quarters full tight); a server that does not say how full
# its cache is counts as empty (its fullness reaches the score as load).
REMOTE_SCALE_BYTES = 16 << 30
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
        # id -> (the _rates entry it was computed from, its step, from, until): steps_now
        self._stepped: dict[str, tuple[tuple[float, float], float, float, float]] = {}

    def record(self, branch_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._rates[branch_id] = (self.rate(branch_id, now) + 1 / self._window_s, now)

    def rate(self, branch_id: str, now: float | None = None) -> float:
        rate, last = self._rates.get(branch_id, (0.0, 0.0))
        if not last:
            return 0.0
        now = time.monotonic() if now is None else now
        return rate * math.exp(-(now - last) / self._window_s)

    def rates_now(self, now: float) -> Callable[[str], float]:
        """``rate(branch_id, now)`` for one ``now``, cheaper per call (routing's hot path)."""
        rates = self._rates
        window = self._window_s
        exp = math.exp

        def rate(branch_id: str) -> float:
            got = rates.get(branch_id)
            return 0.0 if got is None or not got[1] else got[0] * exp((got[1] - now) / window)

        return rate

    def steps_now(self, now: float) -> Callable[[str], float]:
        """``_steps(rate(branch_id, now))`` for one ``now``, the stepped rate routing keys its
        records on. A branch's rate only decays between its requests, so its step holds
        until a time worked out when it was last computed; until then (and until the next
        request replaces the branch's entry) it is returned without an ``exp`` or a ``log``."""
        rates = self._rates
        cache = self._stepped
        window = self._window_s
        exp = math.exp

        def stepped(branch_id: str) -> float:
            got = rates.get(branch_id)
            if got is None or not got[1]:
                return 0.0
            hit = cache.get(branch_id)
            if hit is not None and hit[0] is got and hit[2] <= now < hit[3]:
                return hit[1]
            rate = got[0] * exp((got[1] - now) / window)
            step = _steps(rate)
            cache[branch_id] = (got, step, now, now + window * _step_life(rate, step))
            return step

        return stepped

    def last_used(self, branch_id: str) -> float:
        """Monotonic time of the branch's last request; 0 if never."""
        return self._rates.get(branch_id, (0.0, 0.0))[1]


class Lifecycle(Protocol):
    """Which branches take routed traffic (loaded, warmed up, not draining, not failed)."""

    def routable(self, branch: Branch) -> bool: ...


class PlacementView(Protocol):
    def get(self, branch_id: str) -> Placement | None: ...


class BranchStates:
    """``read(model)``: every branch of ``model`` as the policy sees it now.

    A request rereads only what changes per request: each branch's lifecycle (ready,
    draining), load, engine info, popularity and observed speed. The rest — the route,
    placements, breakers, drift verdicts, and each device's free memory, health and heat
    — is read again only when its stamp moves: the route table and device snapshot by
    identity (both replaced whole), placements, breakers and drift by their ``version``
    (a part without one is reread every time), and while any of the model's breakers is
    not closed (a half-open breaker's probes come and go without an opening). Device
    health is thus as of the last snapshot (one poll interval; a worker's crash makes
    its branch not ready at once anyway). The tuple returned is the same object while no
    branch's record changed, and a branch whose inputs return to values it had lately (a
    load going 1, 2, 1) gets back the record it had then, the same object, so the policy
    finds what it computed for it.
    """

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
        degraded_version: Callable[[], object] = object,
        speeds: ObservedSpeeds | None = None,
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
        self._speeds = speeds or ObservedSpeeds()
        # With a stale device reading, free memory counts as at most this (routing's tight
        # threshold): routing turns conservative — the cheapest branch that meets the
        # bound — never optimistic on a reading that may be long out of date.
        self._stale_free_cap_bytes = stale_free_cap_bytes
        # A version stamp per part; ``object`` (a new, unequal object per call) for a part
        # that has none, so it is reread every time.
        self._placement_version: Callable[[], object] = (
            (lambda: placements.version) if hasattr(placements, "version") else object
        )
        self._degraded_version = degraded_version
        self._models: dict[str, _Model] = {}

    @property
    def speeds(self) -> ObservedSpeeds:
        return self._speeds

    def read(self, model: str) -> tuple[BranchState, ...]:
        """Cheap enough for every request (see the class docstring)."""
        route = self._routes.current.models.get(model)
        if route is None:
            return ()
        snapshot = self._snapshot()
        now = time.monotonic()
        cap = self._stale_free_cap_bytes
        stale = cap is not None and snapshot is not None and snapshot.is_stale(now)
        stamp = (
            route,
            snapshot,
            stale,
            self._placement_version(),
            self._breakers.version,
            self._degraded_version(),
        )
        m = self._models.get(model)
        if m is None or not m.closed or m.stamp != stamp:
            m = self._models[model] = self._slow(route, snapshot, stale, stamp)
            if len(self._models) > 2 * len(self._routes.current.models) + 16:
                live = self._routes.current.models
                for gone in [k for k in self._models if k not in live]:
                    del self._models[gone]
        routable = self._lifecycle.routable
        popularity = self._popularity
        entries, stepped_cache = popularity._rates, popularity._stepped
        stepped = popularity.steps_now(now)
        speeds, max_age_s = self._speeds.table()
        keys = m.keys
        records = m.records
        changed = False
        # steps_now and speeds.get inlined for their common case: two dict reads, no calls
        for k, b, engine, branch_id in m.members:
            entry = entries.get(branch_id)
            if entry is None:
                rate = 0.0  # never routed to
            else:
                hit = stepped_cache.get(branch_id)
                if hit is not None and hit[0] is entry and hit[2] <= now < hit[3]:
                    rate = hit[1]
                else:
                    rate = stepped(branch_id)
            speed = speeds.get(branch_id)
            if speed is not None and now - speed.at > max_age_s:
                speed = None
            key: _Key = (routable(b), engine.in_flight, engine.info, rate, speed)
            if key != keys[k]:
                keys[k] = key
                records[k] = m.record(k, key)
                changed = True
        if changed or m.states is None:
            m.states = tuple(records)
        return m.states

    def _slow(
        self,
        route: ModelRoute,
        snapshot: DeviceSnapshot | None,
        stale: bool,
        stamp: tuple[object, ...],
    ) -> _Model:
        """Read the parts that change rarely, once for every branch of ``route``."""
        cap = self._stale_free_cap_bytes
        devices: dict[str, tuple[int, int, float, float]] = {}
        fixed = []
        closed = True
        for b in route.branches:
            placement = self._placements.get(b.id)
            device_id = placement.device if placement and placement.device else "cpu"
            seen = devices.get(device_id)
            if seen is None and device_id.startswith("remote:"):
                seen = devices[device_id] = _remote_memory(b.engine)
            if seen is None:
                device = snapshot.device(device_id) if snapshot is not None else None
                free = _free(self._margin.headroom(device), cap, stale) if device else 0
                total = device.total_bytes if device else 0
                seen = (free, total, self._health.factor(device_id), thermal_pressure(device))
                devices[device_id] = seen
            closed = closed and self._breakers.closed(b.id)
            fixed.append((placement, self._breakers.is_open(b.id), self._degraded(b.id), seen))
        old = self._models.get(route.name)
        n = len(route.branches)
        if old is not None and old.route is route and old.fixed == fixed:
            kept = _Model(
                route, stamp, old.fixed, closed, old.static, old.keys, old.records, old.states
            )
            kept.seen = old.seen
            return kept
        return _Model(route, stamp, fixed, closed, [None] * n, [None] * n, [None] * n, None)  # type: ignore[list-item]


_Fixed = tuple[Placement | None, bool, bool, tuple[int, int, float, float]]
_Key = tuple[bool, int, EngineInfo | None, float, ObservedSpeed | None]


_SEEN_MAX = 8  # records remembered per branch


class _Model:
    """One model's records and what they were built from."""

    __slots__ = (
        "closed",
        "fixed",
        "keys",
        "members",
        "records",
        "route",
        "seen",
        "stamp",
        "states",
        "static",
    )

    def __init__(
        self,
        route: ModelRoute,
        stamp: tuple[object, ...],
        fixed: list[_Fixed],
        closed: bool,
        static: list[_Static | None],
        keys: list[_Key | None],
        records: list[BranchState],
        states: tuple[BranchState, ...] | None,
    ):
        self.route = route
        # per branch: its place, itself, its engine and id, for the per-request loop
        self.members = [(k, b, b.engine, b.id) for k, b in enumerate(route.branches)]
        self.stamp = stamp
        self.fixed = fixed  # per branch: placement, breaker open, degraded, device figures
        self.closed = closed  # every breaker closed: their version alone says when to reread
        self.static = static  # per branch: its records' static fields, from ``fixed``
        # per branch: its last few records by (ready, in flight, rate step), each with the
        # engine info and speed objects it was built from: a load going up and down (1, 2,
        # 1, 0 sequences) comes back to a record it had, and gets the same object again
        self.seen: list[dict[tuple[bool, int, float], tuple[object, object, BranchState]]] = [
            {} for _ in route.branches
        ]
        self.keys = keys  # per branch: the per-request inputs its record was built from
        self.records = records
        self.states = states

    def record(self, k: int, key: _Key) -> BranchState:
        """Branch ``k``'s record for ``key``: one it had for the same inputs, or a new one."""
        ready, in_flight, info, rate, speed = key
        seen = self.seen[k]
        got = seen.get((ready, in_flight, rate))
        if got is not None and got[0] is info and got[1] is speed:
            return got[2]
        static = self.static[k]
        if static is None:
            static = self.static[k] = _static(
                self.route.reference, self.route.branches[k], self.fixed[k]
            )
        record = _state(static, *key)
        if len(seen) >= _SEEN_MAX:
            seen.clear()
        seen[ready, in_flight, rate] = (info, speed, record)
        return record


# A record is rebuilt on most requests under load (its branch's load moved), and a frozen
# dataclass's ``__init__`` (keyword arguments, a frozen ``__setattr__`` per field) costs
# about 6 µs for BranchState's 27 fields. So records are filled through the slots'
# descriptors instead: the fields that hold while the branch's fixed inputs do are worked
# out once (``_static``), the per-request ones set on each rebuild (``_state``). Every field
# is one or the other (checked here, so a new field cannot be left unset).
_STATIC = (
    "id",
    "model",
    "name",
    "precision",
    "is_reference",
    "breaker_open",
    "degraded",
    "mean_kld",
    "top1",
    "prefill_tps",
    "decode_tps",
    "kv_bytes_per_token",
    "device",
    "device_free_bytes",
    "device_total_bytes",
    "device_health",
    "heat",
    "mean_service_ms",
)
_PER_REQUEST = (
    "ready",
    "running",
    "queued",
    "parallel",
    "recent_rate",
    "observed_ttft_ms",
    "observed_tpot_ms",
    "observed_ttft_dev_ms",
    "observed_tpot_dev_ms",
    "decode_speedup",
)
if sorted(_STATIC + _PER_REQUEST) != sorted(f.name for f in dataclasses.fields(BranchState)):
    raise AssertionError("routing.states: every BranchState field must be static or per request")
_SET_STATIC = tuple(getattr(BranchState, name).__set__ for name in _STATIC)
_SET_PER_REQUEST = tuple(getattr(BranchState, name).__set__ for name in _PER_REQUEST)
_Static = tuple[tuple[Callable[[BranchState, object], None], object], ...]


def _static(reference: str, b: Branch, fixed: _Fixed) -> _Static:
    """The setters and values of the record's :data:`_STATIC` fields."""
    profile = b.profile
    placement, breaker_open, degraded, (free, total, health, heat) = fixed
    values = (
        b.id,
        b.model,
        b.name,
        b.precision,
        b.name == reference,
        breaker_open,
        degraded,
        profile.mean_kld if profile else None,
        profile.top1 if profile else None,
        profile.prefill_tps if profile else None,
        profile.decode_tps if profile else None,
        placement.kv_bytes_per_token if placement else 0,
        placement.device if placement and placement.device else "cpu",
        free,
        total,
        health,
        heat,
        None,
    )
    return tuple(zip(_SET_STATIC, values, strict=True))


def _state(
    static: _Static,
    ready: bool,
    in_flight: int,
    info: EngineInfo | None,
    recent_rate: float,
    speed: ObservedSpeed | None,
) -> BranchState:
    """The branch's record: its static fields and these per-request inputs."""
    parallel = info.parallel if info is not None else 1
    record: BranchState = object.__new__(BranchState)
    for set_field, value in static:
        set_field(record, value)
    values = (
        ready,
        min(in_flight, parallel),
        max(0, in_flight - parallel),
        parallel,
        recent_rate,
        *(
            (speed.ttft_ms, speed.tpot_ms, speed.ttft_dev_ms, speed.tpot_dev_ms)
            if speed is not None
            else (None, None, 0.0, 0.0)
        ),
        info.speedup if info is not None else 1.0,
    )
    for set_field, value in zip(_SET_PER_REQUEST, values, strict=True):
        set_field(record, value)
    return record


_STEP = 2.0**0.25  # a recent rate counts in steps of about a fifth


def _steps(rate: float) -> float:
    """``rate`` rounded to a step of about 19 % (under 0.01 req/s: 0). Popularity decays
    every instant and grows with every request; its record is rebuilt (and the policy's
    ranking computed again) only when it moved by a step. It enters the score times a
    service time (the load term's Little's-law occupancy), where a fifth is noise."""
    if rate < 0.01:
        return 0.0
    return float(_STEP ** round(math.log(rate, _STEP)))


def _step_life(rate: float, step: float) -> float:
    """For how many rate windows a decaying ``rate`` keeps its :func:`_steps` value
    ``step``, a little less to stay clear of rounding at the edge: until it falls below
    the step's lower edge (half a step down) or, for the lowest step, 0.01 req/s."""
    if step == 0.0:
        return math.inf  # under 0.01 req/s, and it only decays
    edge = max(0.01, step * _STEP**-0.5)
    return math.log(rate / edge) - 1e-6 if rate > edge else 0.0


def _remote_memory(engine: object) -> tuple[int, int, float, float]:
    """A remote branch's device figures (free, total, health, heat) from its server's KV
    cache use, as its engine last probed it (``health()``: ``engines/openai``)."""
    health = getattr(engine, "health", None)
    usage = health().get("kv_usage") if callable(health) else None
    used = usage if isinstance(usage, float) else 0.0
    return int(REMOTE_SCALE_BYTES * (1.0 - used)), REMOTE_SCALE_BYTES, 1.0, 0.0


def _free(headroom: int, cap: int | None, stale: bool) -> int:
    """Free-for-routing bytes, capped while the reading is stale."""
    return min(headroom, cap) if stale and cap is not None else headroom

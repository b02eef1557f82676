"""Building branch states: a stale device reading makes routing conservative."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qrtest import fake_table
from quantroute.engines.fake import FakeEngine
from quantroute.resilience import Breakers
from quantroute.routing import RouteTableRef
from quantroute.routing.policy import choose
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import parse_requirement
from quantroute.routing.settings import GiB, RoutingSettings
from quantroute.routing.states import BranchStates, RecentRate, _steps
from quantroute.telemetry import HealthTracker, MarginPolicy
from quantroute.telemetry.memory import Footprint
from quantroute.telemetry.occupancy import Placement
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import DeviceKind, DeviceStats


class _Ready:
    def routable(self, branch: object) -> bool:
        return True


class _Placements:
    def get(self, branch_id: str) -> Placement:
        return Placement("sim:0", Footprint(0, 0, 0, 0), kv_bytes_per_token=1024)


def _states(snapshot: DeviceSnapshot, settings: RoutingSettings) -> BranchStates:
    return BranchStates(
        RouteTableRef(fake_table()),
        lambda: snapshot,
        lifecycle=_Ready(),
        placements=_Placements(),
        degraded=lambda branch_id: False,
        breakers=Breakers(),
        health=HealthTracker(),
        margin=MarginPolicy(min_bytes=0, fraction=0.0),
        popularity=RecentRate(),
        stale_free_cap_bytes=settings.tight_free_bytes - 1,
    )


def test_a_stale_reading_caps_free_memory_so_routing_turns_conservative() -> None:
    settings = RoutingSettings()
    device = DeviceStats("sim:0", DeviceKind.SIM, "sim", 24 * GiB, 0, 24 * GiB)
    now = time.monotonic()
    fresh = DeviceSnapshot(devices=(device,), taken_at=now)
    stale = dataclasses.replace(fresh, taken_at=now - 3600)
    requirement = parse_requirement("fast", None, None, None, settings)
    shape = RequestShape(64, 16)
    free = [s.device_free_bytes for s in _states(fresh, settings).read("tiny-llama")]
    assert free == [24 * GiB] * 3
    ample = choose(
        "tiny-llama", requirement, shape, _states(fresh, settings).read("tiny-llama"), settings
    )
    assert ample.primary == "tiny-llama:f16"  # ample memory: the most faithful
    capped = _states(stale, settings).read("tiny-llama")
    assert {s.device_free_bytes for s in capped} == {settings.tight_free_bytes - 1}
    tight = choose("tiny-llama", requirement, shape, capped, settings)
    assert tight.primary == "tiny-llama:q4_k_m"  # stale: the cheapest that meets the bound


def test_a_record_is_kept_while_its_inputs_hold_and_rebuilt_when_they_move() -> None:
    settings = RoutingSettings()
    device = DeviceStats("sim:0", DeviceKind.SIM, "sim", 24 * GiB, 0, 24 * GiB)
    holder = {"snapshot": DeviceSnapshot(devices=(device,), taken_at=time.monotonic())}
    table = fake_table()
    breakers = Breakers()
    popularity = RecentRate()
    states = BranchStates(
        RouteTableRef(table),
        lambda: holder["snapshot"],
        lifecycle=_Ready(),
        placements=_Placements(),
        degraded=lambda branch_id: False,
        breakers=breakers,
        health=HealthTracker(),
        margin=MarginPolicy(min_bytes=0, fraction=0.0),
        popularity=popularity,
        stale_free_cap_bytes=settings.tight_free_bytes - 1,
    )
    first = states.read("tiny-llama")
    again = states.read("tiny-llama")
    assert all(a is b for a, b in zip(first, again, strict=True))  # nothing moved
    for _ in range(5):  # the default: five failures in a row open it
        breakers.failure("tiny-llama:q8_0")
    for _ in range(20):
        popularity.record("tiny-llama:q4_k_m")
    used = dataclasses.replace(device, used_bytes=8 * GiB, free_bytes=16 * GiB)
    holder["snapshot"] = DeviceSnapshot(devices=(used,), taken_at=time.monotonic())
    moved = states.read("tiny-llama")
    assert all(s.device_free_bytes == 16 * GiB for s in moved)  # the device, for all
    assert moved[2].recent_rate > 0 and first[2].recent_rate == 0
    assert [s.name for s in moved if s.breaker_open] == ["q8_0"]
    assert states.read("tiny-llama")[2] is moved[2]  # and kept again
    # records are filled through their slots, not __init__: each must equal (and hash,
    # print and compare like) the one __init__ builds from its fields
    for record in (*first, *moved):
        built = BranchState(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})
        assert record == built and hash(record) == hash(built) and repr(record) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved[0].running = 3


class _Loaded(FakeEngine):
    """A fake engine whose load the test sets."""

    load = 0

    @property
    def in_flight(self) -> int:
        return self.load


class _VersionedPlacements:
    def __init__(self) -> None:
        self.version = 0
        self.kv = 1024

    def get(self, branch_id: str) -> Placement:
        return Placement("sim:0", Footprint(0, 0, 0, 0), kv_bytes_per_token=self.kv)


def test_a_request_rereads_load_and_breakers_at_once_and_the_rest_when_its_stamp_moves() -> None:
    settings = RoutingSettings()
    device = DeviceStats("sim:0", DeviceKind.SIM, "sim", 24 * GiB, 0, 24 * GiB)
    snapshot = DeviceSnapshot(devices=(device,), taken_at=time.monotonic())
    engines = {n: _Loaded() for n in ("f16", "q8_0", "q4_k_m")}
    for e in engines.values():
        e._ready = True
        e.load = 0
    breakers = Breakers()
    placements = _VersionedPlacements()
    verdicts = {"tiny-llama:q8_0": False}
    drift = {"version": 0}
    states = BranchStates(
        RouteTableRef(fake_table(engines)),  # type: ignore[arg-type]
        lambda: snapshot,
        lifecycle=_Ready(),
        placements=placements,
        degraded=lambda branch_id: verdicts.get(branch_id, False),
        breakers=breakers,
        health=HealthTracker(),
        margin=MarginPolicy(min_bytes=0, fraction=0.0),
        popularity=RecentRate(),
        degraded_version=lambda: drift["version"],
    )
    first = states.read("tiny-llama")
    assert states.read("tiny-llama") is first  # nothing moved: the very same tuple
    engines["q8_0"].load = 3  # a load moves: that record alone is rebuilt
    loaded = states.read("tiny-llama")
    assert loaded is not first and loaded[1].running == 3 and loaded[1].queued == 0
    assert loaded[0] is first[0] and loaded[2] is first[2]
    engines["q8_0"].load = 0  # and back: the record it had for that load, the same object
    back = states.read("tiny-llama")
    assert back[1] is first[1] and back is not first
    engines["q8_0"].load = 3
    assert states.read("tiny-llama")[1] is loaded[1]
    engines["q8_0"]._info = dataclasses.replace(engines["q8_0"]._info, parallel=2)
    halved = states.read("tiny-llama")  # new engine info, same load: a new record
    assert (halved[1].running, halved[1].queued, halved[1].parallel) == (2, 1, 2)
    assert halved[0].decode_speedup == 1.0  # a reference drafting: its measured speed-up
    engines["f16"]._info = dataclasses.replace(engines["f16"]._info, speedup=1.19)
    drafting = states.read("tiny-llama")
    assert drafting[0].decode_speedup == 1.19 and drafting[1] is halved[1]
    # a verdict or placement that changes without its version is not reread (the contract)...
    verdicts["tiny-llama:q8_0"] = True
    placements.kv = 2048
    assert not states.read("tiny-llama")[1].degraded
    drift["version"] += 1  # ...and is, once the version says so
    assert states.read("tiny-llama")[1].degraded
    placements.version += 1
    assert {s.kv_bytes_per_token for s in states.read("tiny-llama")} == {2048}
    for _ in range(5):  # a breaker opens: seen on the next request, nothing else changed
        breakers.failure("tiny-llama:q4_k_m")
    assert [s.breaker_open for s in states.read("tiny-llama")] == [False, False, True]
    verdicts["tiny-llama:q8_0"] = False  # while one is not closed, everything is reread
    assert not states.read("tiny-llama")[1].degraded
    # the ranking the policy reuses for the same tuple equals one computed afresh
    requirement = parse_requirement("fast", None, None, None, settings)
    shape = RequestShape(64, 16)
    now = states.read("tiny-llama")
    again = choose("tiny-llama", requirement, shape, now, settings)
    fresh = choose("tiny-llama", requirement, shape, list(now), settings)
    assert again.branch_ids == fresh.branch_ids and again.reason == fresh.reason
    # and another size on the same tuple is computed for that size (memory filter)
    big = RequestShape(24 * GiB // 2048, 16)
    fits = choose("tiny-llama", requirement, big, now, settings)
    assert fits.reason == "best-effort"  # nothing fits: the tier's best effort


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.floats(0.0, 400.0), st.booleans(), st.sampled_from(["a", "b"])),
        min_size=1,
        max_size=40,
    )
)
def test_cached_rate_steps_equal_the_steps_of_the_rate_now(
    events: list[tuple[float, bool, str]],
) -> None:
    """``steps_now`` keeps a branch's step until its decaying rate leaves it; at any later
    time, with requests in between or not, it must equal ``_steps(rate)`` computed now."""
    rates = RecentRate(window_s=60.0)
    now = 1000.0
    for gap, request, branch_id in sorted(events, key=lambda e: e[0]):
        now += gap / 10.0
        if request:
            rates.record(branch_id, now)
        for b in ("a", "b", "never"):
            assert rates.steps_now(now)(b) == _steps(rates.rate(b, now))

from __future__ import annotations

import pytest

from quantroute.routing.residency import ResidencyPlan, ResidentBranch, plan_residency

GiB = 1 << 30


def _branches(loaded: str = "f16 q8 q4", **recent_rate: float) -> list[ResidentBranch]:
    sizes = {"f16": 14 * GiB, "q8": 8 * GiB, "q4": 5 * GiB}
    return [
        ResidentBranch(
            f"m:{n}",
            "m",
            "sim:0",
            size,
            n in loaded.split(),
            rank,
            recent_rate=recent_rate.get(n, 0.0),
            last_used=recent_rate.get(n, 0.0),
        )
        for rank, (n, size) in enumerate(sizes.items())
    ]


@pytest.mark.parametrize(
    ("loaded", "headroom", "recent_rate", "plan"),
    [
        # enough room: nothing moves
        ("f16 q8 q4", 2 * GiB, {}, ResidencyPlan()),
        # over budget by 1 GiB: the coldest goes; among equals, the most expensive
        ("f16 q8 q4", -1 * GiB, {}, ResidencyPlan(unload=("m:f16",))),
        # ...but recent_rate protects the branches in use: here the cold q4 goes
        ("f16 q8 q4", -1 * GiB, {"f16": 5.0, "q8": 1.0}, ResidencyPlan(unload=("m:q4",))),
        # hot branches are kept while they fit (18 GiB for the model: f16 alone)
        ("f16 q8 q4", -9 * GiB, {"f16": 5.0, "q8": 1.0}, ResidencyPlan(unload=("m:q8", "m:q4"))),
        # 13 GiB: the hot f16 no longer fits; the cold ones do
        ("f16 q8 q4", -14 * GiB, {"f16": 5.0}, ResidencyPlan(unload=("m:f16",))),
        # the survivor alone does not fit: swapped for the most faithful smaller one that does
        ("f16", -2 * GiB, {"f16": 5.0}, ResidencyPlan(unload=("m:f16",), load=("m:q8",))),
        ("f16", -7 * GiB, {"f16": 5.0}, ResidencyPlan(unload=("m:f16",), load=("m:q4",))),
        # deep pressure: unload until within budget, keeping one branch of the model
        ("f16 q8 q4", -30 * GiB, {}, ResidencyPlan(unload=("m:f16", "m:q8"))),
        # nothing of the model fits: it keeps its smallest loaded branch
        ("q4", -3 * GiB, {}, ResidencyPlan()),
        # nothing loaded: the cheapest branch that fits comes back (not f16: no room)
        ("", 6 * GiB, {}, ResidencyPlan(load=("m:q4",))),
        # nothing fits at all: nothing to do
        ("", 1 * GiB, {}, ResidencyPlan()),
        # room again (footprint + margin): the most faithful unloaded branch returns first
        ("q4", 15 * GiB, {}, ResidencyPlan(load=("m:f16",))),
        # room for q8 but not f16 (+ margin): q8 returns
        ("q4", 9 * GiB, {}, ResidencyPlan(load=("m:q8",))),
        # hysteresis: exactly q8's footprint is not enough without the margin
        ("q4", 8 * GiB, {}, ResidencyPlan()),
    ],
)
def test_plan(
    loaded: str, headroom: int, recent_rate: dict[str, float], plan: ResidencyPlan
) -> None:
    got = plan_residency(
        _branches(loaded, **recent_rate), {"sim:0": headroom}, reload_margin_bytes=GiB // 2
    )
    assert got == plan


def test_devices_are_planned_separately() -> None:
    branches = [
        ResidentBranch("a:f16", "a", "sim:0", 10 * GiB, True, 0),
        ResidentBranch("a:q4", "a", "sim:0", 4 * GiB, True, 6),
        ResidentBranch("b:f16", "b", "sim:1", 10 * GiB, False, 0),
        ResidentBranch("b:q4", "b", "sim:1", 4 * GiB, True, 6),
    ]
    plan = plan_residency(branches, {"sim:0": -GiB, "sim:1": 20 * GiB}, reload_margin_bytes=GiB)
    assert plan == ResidencyPlan(unload=("a:f16",), load=("b:f16",))

"""A reload keeps a branch's drift verdict when its worker and baseline stay the same."""

from __future__ import annotations

import dataclasses

from quantroute.config import DriftSettings
from quantroute.quality.drift import Baseline, DriftMonitor


def _monitor(baselines: dict[str, Baseline]) -> DriftMonitor:
    ref = {b: "m:f16" for b in baselines}
    return DriftMonitor(DriftSettings(), reference=ref, scorers={}, baselines=baselines)


def test_verdicts_carry_over_only_for_the_same_worker_and_baseline() -> None:
    old = _monitor({"m:q8_0": Baseline(0.001, 0.99), "m:q4_k_m": Baseline(0.01, 0.94)})
    for b in ("m:q8_0", "m:q4_k_m"):
        old._states[b] = dataclasses.replace(old.state(b), degraded=True, windows=7)
    new = _monitor({"m:q8_0": Baseline(0.001, 0.99), "m:q4_k_m": Baseline(0.02, 0.90)})
    new.adopt(old, ["m:q8_0", "m:q4_k_m", "m:gone"])
    assert new.degraded("m:q8_0") and new.state("m:q8_0").windows == 7
    assert not new.degraded("m:q4_k_m")  # re-profiled: judged afresh against the new numbers
    fresh = _monitor({"m:q8_0": Baseline(0.001, 0.99)})
    fresh.adopt(old, [])  # a new worker: nothing carried
    assert not fresh.degraded("m:q8_0")

"""The goodput benchmark's own arithmetic (benchmarks/goodput_report.py, bench_goodput.py's
schedule): what counts as good, a violation, a phase's best static policy."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_goodput as bg
import goodput_report as rep

PROFILES = {
    "m:f16": {"reference": True, "size_bytes": 300, "mean_kld": 0.0, "top1": 1.0},
    "m:q8_0": {"reference": False, "size_bytes": 160, "mean_kld": 3.6e-4, "top1": 0.989},
    "m:q4_k_m": {"reference": False, "size_bytes": 95, "mean_kld": 1.4e-2, "top1": 0.933},
}
BOUNDS = {
    "exact": rep.Bounds(True, 0.0, None),
    "high": rep.Bounds(False, 0.001, 0.98),
    "balanced": rep.Bounds(False, 0.02, 0.9),
    "fast": rep.Bounds(False, None, None),
}


def test_static_tier_map_takes_each_tiers_cheapest_branch_that_meets_its_bound() -> None:
    assert rep.static_tier_map(PROFILES, BOUNDS) == {
        "exact": "m:f16",
        "high": "m:q8_0",
        "balanced": "m:q4_k_m",
        "fast": "m:q4_k_m",
    }


def _outcome(**kw: object) -> rep.Outcome:
    base: dict[str, object] = {
        "index": 0, "tier": "balanced", "target": "m", "due_s": 1.0, "deadline_ms": 100.0,
        "max_tokens": 8, "sent_s": 1.0, "done_s": 1.05, "status": 200, "branch": "m:q8_0",
        "ttft_s": 0.01, "tokens": 8, "finish_reason": "length", "complete": True,
    }  # fmt: skip
    o = rep.Outcome(**(base | kw))  # type: ignore[arg-type]
    o.judge(PROFILES, BOUNDS)
    return o


def test_a_request_is_good_only_if_whole_in_time_from_its_due_time_on_a_branch_meeting_its_tier():
    assert _outcome().good
    # the deadline counts from the due time: a late send is the policy's loss
    assert not _outcome(sent_s=1.04, done_s=1.11).good
    assert _outcome(sent_s=1.04, done_s=1.11).late_s > 0.03
    assert not _outcome(finish_reason="deadline").good  # cut by the server
    assert not _outcome(tokens=7).good  # short
    assert not _outcome(complete=False, error="engine_error").good
    exact_on_q8 = _outcome(tier="exact")
    assert exact_on_q8.violation and not exact_on_q8.good
    refused = _outcome(status=503, branch=None, error="service_unavailable")
    assert not refused.violation and not refused.good


def test_phase_goal_compares_with_the_best_static_policy_that_has_no_violation() -> None:
    def s(policy: str, good: int, violations: int, kld: float | None) -> rep.Summary:
        return rep.Summary(policy, 10.0, 50, good, good / 10.0, violations, 0, {}, {}, kld,
                           None, None, None, None)  # fmt: skip

    goal = rep.phase_goal(
        [
            s(rep.QUANTROUTE, 40, 0, 1e-3),
            s(rep.Q4, 48, 9, 1.4e-2),  # more goodput, but it violates: not a comparison
            s(rep.STATIC_TIER, 40, 0, 1.2e-2),
            s(rep.F16, 20, 0, 0.0),
        ]
    )
    assert goal is not None and goal.best_static == rep.STATIC_TIER
    assert goal.ratio == 1.0 and goal.kld_lower and goal.met
    worse = rep.phase_goal([s(rep.QUANTROUTE, 39, 0, 1e-3), s(rep.STATIC_TIER, 40, 0, 1e-2)])
    assert worse is not None and not worse.met
    tie_at_reference = rep.phase_goal([s(rep.QUANTROUTE, 20, 0, 0.0), s(rep.F16, 20, 0, 0.0)])
    assert tie_at_reference is not None and tie_at_reference.met


def test_requests_belong_to_the_phase_they_were_due_in() -> None:
    run = rep.Run("p", 20.0, [_outcome(index=i, due_s=t, done_s=t + 9) for i, t in
                              enumerate((0.5, 9.9, 10.0, 19.9))])  # fmt: skip
    assert [[o.index for o in ph] for ph in rep.by_phase(run, 10.0, 2)] == [[0, 1], [2, 3]]


def test_the_schedule_is_seeded_and_its_deadlines_scale_with_the_fastest_measured_branch() -> None:
    args = bg.parse_args(["--duration-s", "5", "--rate", "10"])
    slow = {"f16": bg.Speed("f16", 10.0, 1000.0, None)}
    fast = slow | {"q4_k_m": bg.Speed("q4_k_m", 5.0, 2000.0, None)}
    a, b = bg.schedule(args, slow), bg.schedule(args, fast)
    assert [(p.due_s, p.tier, p.max_tokens, p.slack) for p in a] == [
        (p.due_s, p.tier, p.max_tokens, p.slack) for p in b
    ]
    for p, q in zip(a, b, strict=True):
        assert 1.0 <= p.slack <= 4.0
        assert p.deadline_ms == round(p.slack * (10.0 + 1000.0 * (p.max_tokens - 1) / 1000.0), 1)
        assert q.deadline_ms < p.deadline_ms  # the faster branch sets the tighter deadline

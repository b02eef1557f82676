"""The routing policy on plain data: filters, regime fit, load, deadline, affinity, 503s."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from quantroute.errors import ServiceUnavailableError
from quantroute.routing.policy import Decision, choose, explain
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import Requirement, parse_requirement
from quantroute.routing.score import Regime
from quantroute.routing.settings import GiB, RoutingSettings, Tier
from quantroute.types import Precision

S = RoutingSettings()
MODEL = "tiny-llama"
F16, Q8, Q4 = f"{MODEL}:f16", f"{MODEL}:q8_0", f"{MODEL}:q4_k_m"
SHAPE = RequestShape(prompt_tokens=512, max_tokens=256, prefix="def main():\n")
KV = 64 * 1024  # bytes per token: this shape needs 48 MiB

# The committed demo profile (src/quantroute/demo/repo/tiny-llama/profile.json), rounded:
# (mean_kld, top1, prefill_tps, decode_tps). Predicted latency of SHAPE on an idle branch:
# f16 63.9 ms, q8_0 54.6 ms, q4_k_m 25.6 ms.
DEMO = {
    "f16": (0.0, 1.0, 28589.0, 5570.0),
    "q8_0": (0.00027, 0.9906, 27690.0, 7097.0),
    "q4_k_m": (0.01025, 0.9420, 60238.0, 14987.0),
}


def branch(name: str, free: float = 16 * GiB, **live: Any) -> BranchState:
    """One demo branch on a 24 GiB simulated device with ``free`` bytes free for routing."""
    kld, top1, prefill, decode = DEMO[name.split("@")[0]]
    fields: dict[str, Any] = {
        "id": f"{MODEL}:{name}",
        "model": MODEL,
        "name": name,
        "precision": Precision(name.split("@")[0]),
        "is_reference": name == "f16",
        "mean_kld": kld,
        "top1": top1,
        "prefill_tps": prefill,
        "decode_tps": decode,
        "kv_bytes_per_token": KV,
        "device": "sim:0",
        "device_free_bytes": int(free),
        "device_total_bytes": 24 * GiB,
        "parallel": 4,
    }
    fields.update(live)
    return BranchState(**fields)


def demo(free: float = 16 * GiB, **live: dict[str, Any]) -> list[BranchState]:
    """The three demo branches on one device; ``live`` overrides per branch name."""
    return [branch(n, free, **live.get(n, {})) for n in ("f16", "q8_0", "q4_k_m")]


def req(
    quality: object = None, deadline_ms: str | None = None, settings: RoutingSettings = S
) -> Requirement:
    return parse_requirement(quality, None, deadline_ms, None, settings)


def route(
    branches: list[BranchState],
    requirement: Requirement | None = None,
    shape: RequestShape = SHAPE,
    settings: RoutingSettings = S,
) -> Decision:
    decision = choose("tiny-llama", requirement or req(), shape, branches, settings)
    # the input order never matters
    for perm in itertools.islice(itertools.permutations(branches), 1, 6):
        again = choose("tiny-llama", requirement or req(), shape, list(perm), settings)
        assert (again.branch_ids, again.reason) == (decision.branch_ids, decision.reason)
    return decision


# ---- the memory-regime table ------------------------------------------------------------------

ONLY_F16 = {"max_kld": 0.0001}  # q8_0's 0.00027 is over it


@pytest.mark.parametrize(
    ("free", "quality", "primary", "reason"),
    [
        (24 * GiB, None, F16, "best-fit:ample"),
        (8 * GiB, None, F16, "best-fit:ample"),
        (8 * GiB - 1, None, Q8, "best-fit:constrained"),
        (6 * GiB, None, Q8, "best-fit:constrained"),
        (4 * GiB, None, Q8, "best-fit:constrained"),
        (4 * GiB - 1, None, Q4, "best-fit:tight"),
        (1 * GiB, None, Q4, "best-fit:tight"),
        # an explicit bound only the reference meets: the reference, in any regime
        (6 * GiB, ONLY_F16, F16, "only-feasible"),
        (1 * GiB, ONLY_F16, F16, "only-feasible"),
        (6 * GiB, {"min_top1": 0.995}, F16, "only-feasible"),
        (1 * GiB, "exact", F16, "only-feasible"),
        # tiers through the regimes
        (6 * GiB, "high", Q8, "best-fit:constrained"),
        (1 * GiB, "high", Q8, "best-fit:tight"),  # q4_k_m is below "high"
        (24 * GiB, "fast", F16, "best-fit:ample"),
        (1 * GiB, "fast", Q4, "best-fit:tight"),
    ],
)
def test_regime_table(free: int, quality: object, primary: str, reason: str) -> None:
    decision = route(demo(free), req(quality))
    assert decision.primary == primary
    assert decision.reason == reason
    assert decision.wait_s is None


@pytest.mark.parametrize(
    ("quality", "ids"),
    [
        (None, (Q8, Q4, F16)),
        ("high", (Q8, F16)),  # fallbacks never include a branch below the bound
        (ONLY_F16, (F16,)),
    ],
)
def test_fallbacks_are_the_other_feasible_branches_by_score(
    quality: object, ids: tuple[str, ...]
) -> None:
    assert route(demo(6 * GiB), req(quality)).branch_ids == ids


# ---- nothing feasible -------------------------------------------------------------------------

BIG = RequestShape(prompt_tokens=100_000, max_tokens=4096, prefix="x")  # 6.5 GB of KV at 64 KiB


@pytest.mark.parametrize("quality", [ONLY_F16, "high", "balanced", None])
def test_no_silent_downgrade_below_the_bound(quality: object) -> None:
    # the reference has no room; q8_0 and q4_k_m do, but they do not meet the bound
    branches = demo(4 * GiB)
    branches[0] = replace(branches[0], device="sim:1", device_free_bytes=1 * GiB)
    branches[1] = replace(branches[1], ready=False)
    if quality in (None, "balanced"):
        branches[2] = replace(branches[2], degraded=True)
    with pytest.raises(ServiceUnavailableError) as info:
        choose("tiny-llama", req(quality), BIG, branches, S)
    assert info.value.retry_after_s == S.retry_after_s
    assert info.value.status == 503
    assert "memory" in info.value.message and "quality" in info.value.message


def test_exact_waits_for_the_reference() -> None:
    branches = demo(16 * GiB, f16={"ready": False})
    decision = route(branches, req("exact"))
    assert decision.branch_ids == () and decision.primary is None
    assert (decision.reason, decision.wait_s) == ("wait:reference", S.tiers.exact.wait_s)
    # ...but never longer than the deadline leaves after the reference's own service time
    decision = route(branches, req("exact", deadline_ms="2063.9"))
    assert decision.wait_s == pytest.approx(2.0, abs=0.01)
    # the same bound given as numbers is not the tier: a 503, no wait
    with pytest.raises(ServiceUnavailableError):
        choose("tiny-llama", req({"max_kld": 0}), SHAPE, branches, S)


@pytest.mark.parametrize(
    ("live", "deadline"),
    [
        ({"f16": {"ready": False}}, "60"),  # even an idle reference needs 63.9 ms
        ({"f16": {"device_total_bytes": 4 * GiB, "device_free_bytes": 1 * GiB}}, None),
    ],
)
def test_exact_does_not_wait_when_waiting_cannot_help(
    live: dict[str, dict[str, Any]], deadline: str | None
) -> None:
    shape = BIG if deadline is None else SHAPE
    with pytest.raises(ServiceUnavailableError):
        choose("tiny-llama", req("exact", deadline), shape, demo(16 * GiB, **live), S)


def test_exact_without_a_reference_in_the_table_is_503() -> None:
    with pytest.raises(ServiceUnavailableError):
        choose("tiny-llama", req("exact"), SHAPE, demo()[1:], S)


@pytest.mark.parametrize("quality", ["exact", "high", "balanced", "fast", {"max_kld": 1.0}])
def test_nothing_ready_is_503_for_every_tier(quality: object) -> None:
    branches = demo(f16={"ready": False}, q8_0={"breaker_open": True}, q4_k_m={"ready": False})
    with pytest.raises(ServiceUnavailableError) as info:
        choose("tiny-llama", req(quality), SHAPE, branches, S)
    assert info.value.retry_after_s == S.retry_after_s


@pytest.mark.parametrize(
    ("live", "ids"),
    [
        ({}, (Q4, Q8, F16)),
        ({"q4_k_m": {"ready": False}}, (Q8, F16)),
        ({"q4_k_m": {"breaker_open": True}}, (Q8, F16)),
        ({"q4_k_m": {"ready": False}, "q8_0": {"degraded": True}}, (Q8, F16)),
    ],
)
def test_fast_is_best_effort_cheapest_ready(
    live: dict[str, dict[str, Any]], ids: tuple[str, ...]
) -> None:
    # nothing has room for BIG: "fast" still answers, on the cheapest ready branch
    decision = route(demo(1 * GiB, **live), req("fast"), shape=BIG)
    assert (decision.branch_ids, decision.reason) == (ids, "best-effort")
    with pytest.raises(ServiceUnavailableError):
        choose("tiny-llama", req("balanced"), BIG, demo(1 * GiB, **live), S)


# ---- filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("live", "quality", "ids"),
    [
        ({"q8_0": {"ready": False}}, None, (Q4, F16)),
        ({"q8_0": {"breaker_open": True}}, None, (Q4, F16)),
        ({"q8_0": {"degraded": True}}, None, (Q4, F16)),
        ({"q8_0": {"degraded": True}}, "fast", (Q8, Q4, F16)),  # fast has no bound to fail
        ({"q8_0": {"degraded": True}}, {"max_kld": 1.0}, (Q4, F16)),
        ({"q8_0": {"mean_kld": None, "top1": None}}, None, (Q4, F16)),
        ({"q8_0": {"mean_kld": None, "top1": None}}, {"min_top1": 0.1}, (Q4, F16)),
        # unprofiled ranks last in fidelity: q4_k_m moves up to the constrained regime's fit
        ({"q8_0": {"mean_kld": None, "top1": None}}, "fast", (Q4, Q8, F16)),
        ({"q8_0": {"top1": None}}, {"max_kld": 0.1}, (Q8, Q4, F16)),  # only KLD asked
        # the reference meets every bound, profiled or not, degraded flag or not
        ({"f16": {"mean_kld": None, "top1": None, "degraded": True}}, ONLY_F16, (F16,)),
        ({"q4_k_m": {"mean_kld": 0.0, "top1": 1.0}}, "exact", (F16,)),  # max_kld 0: only ref
        # memory: the request's KV cache must fit the branch's device
        ({"q8_0": {"device": "sim:1", "device_free_bytes": 48 * 2**20 - 1}}, None, (Q4, F16)),
        # just enough room: feasible, but a tight device and no headroom put it last
        ({"q8_0": {"device": "sim:1", "device_free_bytes": 48 * 2**20}}, None, (Q4, F16, Q8)),
    ],
)
def test_hard_filters(
    live: dict[str, dict[str, Any]], quality: object, ids: tuple[str, ...]
) -> None:
    # 6 GiB free: constrained, where q8_0 would be the first choice
    branches = demo(6 * GiB)
    branches = [replace(b, **live.get(b.name, {})) for b in branches]
    assert route(branches, req(quality)).branch_ids == ids


@pytest.mark.parametrize(
    ("deadline", "live", "ids"),
    [
        (None, {}, (F16, Q8, Q4)),
        ("70", {}, (F16, Q8, Q4)),
        ("60", {}, (Q8, Q4)),  # f16 needs 63.9 ms
        ("40", {}, (Q4,)),
        ("20", {}, None),  # nothing is that fast: balanced -> 503
        # queue wait: 4 queued + all 4 slots busy = 5 ahead, each 25.6 ms / 4 slots: 57.6 ms
        ("40", {"q4_k_m": {"running": 4, "queued": 4}}, None),
        ("60", {"q4_k_m": {"running": 4, "queued": 4}}, (Q8, Q4)),
        ("60", {"q4_k_m": {"running": 4, "queued": 8}}, (Q8,)),  # 83.2 ms
        ("60", {"q4_k_m": {"running": 3}}, (Q8, Q4)),  # a slot is free: no wait
        # a measured mean service time replaces the estimate
        ("60", {"q4_k_m": {"queued": 1, "mean_service_ms": 100.0, "running": 4}}, (Q8,)),
        ("60", {"q4_k_m": {"queued": 1, "mean_service_ms": 10.0, "running": 4}}, (Q8, Q4)),
        # unknown speeds pass the deadline filter
        ("1", {"q8_0": {"prefill_tps": None}}, (Q8,)),
    ],
)
def test_deadline_filter(
    deadline: str | None, live: dict[str, dict[str, Any]], ids: tuple[str, ...] | None
) -> None:
    requirement = req(None, deadline)
    branches = demo(24 * GiB, **live)
    if ids is None:
        with pytest.raises(ServiceUnavailableError):
            choose("tiny-llama", requirement, SHAPE, branches, S)
    else:
        assert route(branches, requirement).branch_ids == ids


def test_a_feasible_deadline_prefers_more_slack() -> None:
    # two q8_0 replicas, one with a queue: with a deadline the idle one's slack counts too
    a = branch("q8_0", device="sim:0")
    b = branch("q8_0@1", device="sim:1", queued=1, running=4)
    scores = {e.branch_id: e.terms[3].value for e in explain(req(None, "200"), SHAPE, [a, b], S)}
    assert scores[a.id] == pytest.approx(1 - 54.6 / 200, abs=0.001)
    assert scores[a.id] > scores[b.id] > 0


# ---- load, health, heat: shifting between near-equal branches ----------------------------------


@pytest.mark.parametrize(
    ("free", "live", "quality", "primary", "reason"),
    [
        # constrained: q8_0 is the fit; full, it loses to an idle q4_k_m
        (6 * GiB, {"q8_0": {"running": 4, "queued": 4}}, None, Q4, "shifted:load"),
        (6 * GiB, {"q8_0": {"running": 2}}, None, Q8, "best-fit:constrained"),
        # a burst not yet in the counters: 100 req/s * 54.6 ms = 5.5 busy slots
        (6 * GiB, {"q8_0": {"recent_rate": 100.0, "running": 1}}, None, Q4, "shifted:load"),
        (6 * GiB, {"q8_0": {"recent_rate": 1.0, "running": 1}}, None, Q8, "best-fit:constrained"),
        # ample: a saturated reference gives way to an idle q8_0 (near-lossless)...
        (24 * GiB, {"f16": {"running": 4, "queued": 4}}, None, Q8, "shifted:load"),
        (24 * GiB, {"f16": {"running": 2}}, None, F16, "best-fit:ample"),
        # ...but load never overrides a hard filter
        (24 * GiB, {"f16": {"running": 4, "queued": 40}}, ONLY_F16, F16, "only-feasible"),
        (6 * GiB, {"q8_0": {"running": 4, "queued": 40}}, "high", F16, "shifted:load"),
        # health and heat of the device shift near-equal choices too
        (
            6 * GiB,
            {"q8_0": {"device": "sim:1", "device_health": 0.5}},
            None,
            Q8,
            "best-fit:constrained",
        ),
        (6 * GiB, {"q8_0": {"device": "sim:1", "device_health": 0.0}}, None, Q4, "shifted:health"),
        (6 * GiB, {"q8_0": {"device": "sim:1", "heat": 1.0}}, None, Q8, "best-fit:constrained"),
    ],
)
def test_load_shifts_between_near_equal_branches(
    free: int, live: dict[str, dict[str, Any]], quality: object, primary: str, reason: str
) -> None:
    decision = route(demo(free, **live), req(quality))
    assert (decision.primary, decision.reason) == (primary, reason)
    if quality == "high":
        assert Q4 not in decision.branch_ids  # below the bound, however idle


def test_devices_compare_by_fit_health_and_headroom() -> None:
    # f16 on an ample device beats q4_k_m on a tight one, though each is its device's best fit
    ample = branch("f16", 16 * GiB, device="sim:0")
    tight = branch("q4_k_m", 2 * GiB, device="sim:1")
    assert route([ample, tight]).branch_ids == (F16, Q4)
    # two replicas of one precision: health, then headroom, decide
    a = branch("q8_0", 6 * GiB, device="sim:0", device_health=0.5)
    b = branch("q8_0@1", 6 * GiB, device="sim:1", id=f"{MODEL}:q8_0@1")
    assert route([a, b], shape=RequestShape(512, 256)).primary == b.id
    c = branch("q8_0@1", 5 * GiB, device="sim:1", id=f"{MODEL}:q8_0@1")
    d = replace(a, device_health=1.0, device_free_bytes=7 * GiB)
    assert route([d, c], shape=RequestShape(512, 256)).primary == d.id


def test_reference_cost_without_a_marked_reference_is_the_widest_branch() -> None:
    branches = [replace(b, is_reference=False) for b in demo(6 * GiB)[1:]]
    # q8_0 is now cost 1.0 > 0.6 and q4_k_m 0.58: the constrained fit picks q4_k_m
    assert route(branches, req("fast")).primary == Q4


def test_custom_thresholds_and_weights() -> None:
    settings = RoutingSettings.model_validate(
        {"ample_free_bytes": 2 * GiB, "tight_free_bytes": GiB, "weights": {"load": 0.0}}
    )
    assert route(demo(3 * GiB), settings=settings).primary == F16
    full = demo(6 * GiB, q8_0={"running": 4, "queued": 4})
    assert route(full, settings=settings).primary == F16
    assert route(full).primary == Q4


# ---- prefix affinity --------------------------------------------------------------------------


def replicas(n: int = 2) -> list[BranchState]:
    return [branch("q8_0", 6 * GiB, id=f"{MODEL}:q8_0@{k}", device=f"sim:{k}") for k in range(n)]


def test_same_prefix_same_branch_across_calls_and_orders() -> None:
    branches = replicas(3)
    for prefix in ("def main():\n", "import os\n", "", "\ud800 lone surrogate"):
        shape = RequestShape(512, 256, prefix)
        picks = {
            choose("tiny-llama", req(), shape, list(perm), S).primary
            for perm in itertools.permutations(branches)
        }
        assert len(picks) == 1


def test_different_prefixes_spread_over_the_tied_branches() -> None:
    branches = replicas(2)
    picks = Counter(
        choose("tiny-llama", req(), RequestShape(512, 256, f"prompt {k}"), branches, S).primary
        for k in range(400)
    )
    assert set(picks) == {b.id for b in branches}
    assert min(picks.values()) > 140  # 400 fair coin flips: 200 +- 3 sigma
    decision = choose("tiny-llama", req(), RequestShape(512, 256, "prompt 0"), branches, S)
    assert decision.reason == "best-fit:constrained+affinity"
    assert set(decision.branch_ids) == {b.id for b in branches}


def test_affinity_only_among_top_k_within_epsilon() -> None:
    three = replicas(3)
    shapes = [RequestShape(512, 256, f"p{k}") for k in range(200)]
    # top_k 2: the third replica (last by id among equals) is never primary
    assert {choose("tiny-llama", req(), s, three, S).primary for s in shapes} == {
        three[0].id,
        three[1].id,
    }
    one = RoutingSettings(top_k=1)
    assert {choose("tiny-llama", req(), s, three, one).primary for s in shapes} == {three[0].id}
    # outside epsilon the better score wins whatever the prefix
    busier = [three[0], replace(three[1], running=2)]  # load term 0.75: 0.075 below
    assert {choose("tiny-llama", req(), s, busier, S).primary for s in shapes} == {three[0].id}
    # no prefix: no affinity, the top score (then id) wins
    assert (
        choose("tiny-llama", req(), RequestShape(512, 256), three, S).reason
        == "best-fit:constrained"
    )


# ---- explanations -----------------------------------------------------------------------------


def test_explanations_cover_every_branch_in_input_order() -> None:
    branches = demo(6 * GiB, q4_k_m={"ready": False})
    decision = choose("tiny-llama", req("high"), SHAPE, branches, S)
    ex = {e.branch_id: e for e in decision.explanations}
    assert [e.branch_id for e in decision.explanations] == [F16, Q8, Q4]
    assert (ex[Q8].position, ex[F16].position, ex[Q4].position) == (0, 1, None)
    assert ex[Q8].regime is Regime.CONSTRAINED and ex[Q8].need_bytes == 48 * 2**20

    q4 = {f.name: f for f in ex[Q4].filters}
    assert [f.name for f in ex[Q4].filters] == ["ready", "breaker", "quality", "memory", "deadline"]
    assert not q4["ready"].passed and q4["ready"].reason == "not ready"
    assert not q4["quality"].passed and q4["quality"].reason.startswith("mean_kld 0.0103 > 0.001")
    assert q4["memory"].passed
    assert not ex[Q4].feasible and ex[Q4].score is None and ex[Q4].terms == ()

    q8 = ex[Q8]
    assert q8.feasible and q8.score == pytest.approx(sum(t.contribution for t in q8.terms))
    assert [t.name for t in q8.terms] == ["fit", "headroom", "load", "latency", "health", "heat"]
    assert q8.terms[0].value == pytest.approx(0.8) and q8.terms[0].weight == 1.0
    assert ex[F16].terms[0].value == pytest.approx(0.6)
    assert q8.to_dict()["filters"][2] == {
        "name": "quality",
        "passed": True,
        "reason": "mean_kld 0.00027 <= 0.001, top1 0.991 >= 0.98",
    }


@pytest.mark.parametrize(
    ("live", "quality", "deadline", "name", "reason"),
    [
        ({"f16": {"ready": False}}, None, None, "ready", "not ready"),
        ({"q8_0": {"degraded": True}}, None, None, "quality", "degraded by the drift monitor"),
        ({"q8_0": {"mean_kld": None}}, None, None, "quality", "unprofiled"),
        ({}, "exact", None, "quality", "only the reference meets max_kld 0"),
        ({}, "fast", None, "quality", "no bound"),
        ({"q8_0": {"decode_tps": None}}, None, "100", "deadline", "unknown speed"),
        ({}, None, "50", "deadline", "predicted 54.6 ms (profile speed) > deadline 50 ms"),
        (
            {"q8_0": {"device_free_bytes": 1000}},
            None,
            None,
            "memory",
            "needs 50331648 B > 1000 B free on sim:0",
        ),
    ],
)
def test_explained_reasons(
    live: dict[str, dict[str, Any]], quality: object, deadline: str | None, name: str, reason: str
) -> None:
    ex = explain(req(quality, deadline), SHAPE, demo(16 * GiB, **live), S)
    target = next(e for e in ex if e.branch_id == (F16 if "f16" in live else Q8))
    check = next(f for f in target.filters if f.name == name)
    assert check.reason == reason
    assert all(e.position is None for e in ex)


def test_a_speculating_reference_is_credited_with_its_measured_speedup() -> None:
    """A reference that drafts decodes ``decode_speedup`` times its profile's speed: the
    deadline filter predicts with it (while the branch has no observed speed) and says
    so; an exact request that plain decoding would miss meets its deadline drafted."""
    plain = explain(req("exact", "55"), SHAPE, demo(), S)
    f16 = next(e for e in plain if e.branch_id == F16)
    assert next(f for f in f16.filters if f.name == "deadline").passed is False
    drafted = demo(f16={"decode_speedup": 1.3})
    ex = explain(req("exact", "55"), SHAPE, drafted, S)
    deadline = next(
        f for f in next(e for e in ex if e.branch_id == F16).filters if f.name == "deadline"
    )
    # 512 / 28589 s to prefill, 256 / (1.3 * 5570) s to decode: 53.3 ms
    assert deadline.passed and deadline.reason == (
        "predicted 53.3 ms (profile, drafting x1.30 speed) <= deadline 55 ms"
    )
    assert route(drafted, req("exact", "55")).branch_ids[0] == F16
    # a request the reference would decode plainly (a grammar, logprobs, penalties, a
    # seeded sample) gets no credit: it misses as it would undrafted
    plain_shape = replace(SHAPE, drafted=False)
    ex = explain(req("exact", "55"), plain_shape, drafted, S)
    f16 = next(e for e in ex if e.branch_id == F16)
    deadline = next(f for f in f16.filters if f.name == "deadline")
    assert not deadline.passed and "drafting" not in deadline.reason
    # an observed speed already is drafting's (what requests saw): no second credit
    observed = demo(f16={"decode_speedup": 1.3, "observed_ttft_ms": 20.0, "observed_tpot_ms": 0.2})
    ex = explain(req("exact", "55"), SHAPE, observed, S)
    f16 = next(e for e in ex if e.branch_id == F16)
    assert "(observed speed)" in next(f for f in f16.filters if f.name == "deadline").reason


def test_wait_and_best_effort_decisions_explain_too() -> None:
    wait = choose("tiny-llama", req("exact"), SHAPE, demo(f16={"ready": False}), S)
    assert [e.position for e in wait.explanations] == [None, None, None]
    best = choose("tiny-llama", req("fast"), BIG, demo(1 * GiB), S)
    assert [e.position for e in best.explanations] == [2, 1, 0]
    assert all(not e.feasible for e in best.explanations)


def test_tier_names_are_the_enum() -> None:
    assert {t.value for t in Tier} == {"exact", "high", "balanced", "fast"}


def test_affinity_across_a_fit_gap_says_near_tie() -> None:
    wide = RoutingSettings(tie_epsilon=0.5)  # q8_0 (0.8) and q4_k_m (0.64) now tie
    seen: dict[str, set[str]] = {}
    for k in range(100):
        d = choose("tiny-llama", req(), RequestShape(512, 256, f"p{k}"), demo(6 * GiB), wide)
        seen.setdefault(d.primary or "", set()).add(d.reason)
    assert seen == {
        Q8: {"best-fit:constrained+affinity"},
        Q4: {"near-tie+affinity"},
    }


def test_a_zero_deadline_built_by_hand_does_not_divide_by_zero() -> None:
    requirement = Requirement(None, None, None, deadline_ms=0.0)
    decision = choose("tiny-llama", requirement, RequestShape(0, 0), demo(), S)
    assert decision.primary == F16
    assert decision.explanations[0].terms[3].value == 0.0


def test_a_reused_ranking_equals_one_computed_afresh() -> None:
    """``choose`` reuses its ranking for the same states tuple, requirement and size; over
    random states, loads, deadlines and sizes it must give what a fresh list gives."""
    import random

    rng = random.Random(15)
    tiers = [None, "exact", "high", "balanced", "fast"]
    shapes = [RequestShape(p, m, pre) for p in (16, 512) for m in (8, 256) for pre in ("", "a")]
    for _ in range(60):
        states = tuple(
            branch(
                name,
                rng.choice([1 * GiB, 6 * GiB, 16 * GiB]),
                ready=rng.random() > 0.1,
                running=rng.randrange(5),
                queued=rng.randrange(3),
                recent_rate=rng.choice([0.0, 0.5, 40.0]),
                observed_ttft_ms=rng.choice([None, 5.0, 80.0]),
                observed_tpot_ms=rng.choice([None, 0.5, 4.0]),
            )
            for name in ("f16", "q8_0", "q4_k_m")
        )
        for _ in range(3):
            requirement = req(rng.choice(tiers), rng.choice([None, "40", "400"]))
            shape = rng.choice(shapes)
            outcomes = []
            for branches in (states, states, list(states)):  # fresh, reused, never reused
                try:
                    d = choose(MODEL, requirement, shape, branches, S)
                    outcomes.append((d.branch_ids, d.reason, d.wait_s))
                except ServiceUnavailableError as exc:
                    outcomes.append(("503", str(exc), exc.retry_after_s))
            assert outcomes[0] == outcomes[1] == outcomes[2]


# What a request, a poll or a breaker can change in one branch's record between decisions.
_CHURN = {
    "running": st.integers(0, 6),
    "queued": st.integers(0, 3),
    "ready": st.booleans(),
    "breaker_open": st.booleans(),
    "degraded": st.booleans(),
    "recent_rate": st.sampled_from([0.0, 0.5, 40.0]),
    "observed_ttft_ms": st.sampled_from([None, 5.0, 80.0]),
    "observed_tpot_ms": st.sampled_from([None, 0.5, 4.0]),
    "observed_ttft_dev_ms": st.sampled_from([0.0, 30.0]),
    "device_free_bytes": st.sampled_from([1 * GiB, 6 * GiB, 16 * GiB, 40 * 2**20]),
    "device_health": st.sampled_from([0.0, 0.5, 1.0]),
    "heat": st.sampled_from([0.0, 0.7]),
    "mean_kld": st.sampled_from([None, 0.0002, 0.003, 0.2]),  # moves the fidelity ladder
    "mean_service_ms": st.sampled_from([None, 20.0, 900.0]),
}
_REPLICAS = ("f16", "q8_0", "q4_k_m", "f16@1", "q8_0@1", "q4_k_m@1")
_MARGIN = S.model_copy(update={"speeds": S.speeds.model_copy(update={"margin_deviations": 2})})


def _outcome(branches: Any, requirement: Requirement, shape: RequestShape, s: Any) -> Any:
    try:
        d = choose(MODEL, requirement, shape, branches, s)
    except ServiceUnavailableError as exc:
        return ("503", str(exc), exc.retry_after_s)
    return (d.branch_ids, d.reason, d.wait_s, [e.to_dict() for e in d.explanations])


@hsettings(max_examples=200, deadline=None)
@given(
    changes=st.lists(
        st.tuples(
            st.sampled_from(["set", "load", "load", "back", "back", "swap"]),
            st.integers(0, len(_REPLICAS) - 1),
            st.dictionaries(st.sampled_from(sorted(_CHURN)), st.none(), min_size=1, max_size=2),
            st.data(),
        ),
        min_size=1,
        max_size=14,
    ),
    tier=st.sampled_from([None, "exact", "high", "balanced", "fast"]),
    deadline=st.sampled_from([None, "40", "400"]),
    shape=st.sampled_from([RequestShape(16, 8, "a"), RequestShape(512, 256, "p")]),
    margin=st.booleans(),
)
def test_a_ranking_updated_under_churn_equals_one_computed_afresh(
    changes: list[tuple[str, int, dict[str, None], Any]],
    tier: str | None,
    deadline: str | None,
    shape: RequestShape,
    margin: bool,
) -> None:
    """Under churn a new states tuple differs from the last in a record or two (the others
    the same objects), and ``choose`` filters and scores only those again, or takes what it
    remembers of a record it saw before (``BranchStates`` hands a branch's earlier record
    back when its load returns). Whatever changed (load, readiness, breakers, memory,
    speeds, the fidelity ladder, an earlier record back, two records swapped), the decision
    and every explanation must be what a fresh computation (a list, never reused) gives."""
    s = _MARGIN if margin else S
    requirement = req(tier, deadline)
    states = tuple(branch(name, 16 * GiB, running=1) for name in _REPLICAS)
    history = {b.id: [b] for b in states}  # each branch's records so far
    _outcome(states, requirement, shape, s)  # the ranking the first change updates
    for kind, k, fields, data in changes:
        if kind in ("set", "load"):
            new = replace(
                states[k],
                **{f: data.draw(_CHURN[f], label=f) for f in fields}
                if kind == "set"
                else {"running": data.draw(st.integers(0, 5), label="running")},
            )
            history[new.id].append(new)
        elif kind == "back":
            new = data.draw(st.sampled_from(history[states[k].id]), label="back")
        else:
            other = data.draw(st.integers(0, len(states) - 1), label="swap")
            states = tuple(
                states[other] if n == k else states[k] if n == other else b
                for n, b in enumerate(states)
            )
            new = states[k]
        states = (*states[:k], new, *states[k + 1 :])
        assert _outcome(states, requirement, shape, s) == _outcome(
            list(states), requirement, shape, s
        )


def test_remembered_affinity_hashes_equal_the_hashes() -> None:
    """``prefix_key`` and ``weight`` remember their blake2b results; what they remember
    must be what blake2b gives, on the first call, the next, and after the cache is full."""
    from hashlib import blake2b

    from quantroute.routing import affinity

    for n in range(2 * affinity._CACHE_MAX + 3):
        prefix = f"prefix {n % (affinity._CACHE_MAX + 7)}"
        raw = blake2b(prefix.encode(), digest_size=32, person=b"qr-affinity").digest()
        for _ in range(2):
            key = affinity.prefix_key(prefix)
            assert key == raw
            want = int.from_bytes(blake2b(b"m:q8_0", digest_size=8, key=raw).digest(), "big")
            assert affinity.weight(key, "m:q8_0") == want
    assert len(affinity._keys) <= affinity._CACHE_MAX
    assert len(affinity._weights) <= affinity._CACHE_MAX

"""Deadlines from real speeds: the router learns each branch's end-to-end speed from the
requests it served, and the deadline filter predicts with it once there is some."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qrtest import ADMIN_KEY, fake_app, serving
from quantroute.engines.fake import FakeEngine
from quantroute.routing.filters import DEADLINE, evaluate
from quantroute.routing.policy import choose
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import parse_requirement
from quantroute.routing.settings import GiB, RoutingSettings
from quantroute.routing.speeds import STEP, ObservedSpeeds, observe_finished
from quantroute.types import Precision

S = RoutingSettings()
SHAPE = RequestShape(prompt_tokens=64, max_tokens=65)


def _branch(name: str, **live: object) -> BranchState:
    # the profile says 10k tok/s decode, 30k prefill: 8.6 ms for SHAPE, engine alone
    fields: dict[str, object] = {
        "id": f"m:{name}",
        "model": "m",
        "name": name,
        "precision": Precision(name),
        "is_reference": name == "f16",
        "mean_kld": 0.0 if name == "f16" else 0.01,
        "top1": 1.0 if name == "f16" else 0.95,
        "prefill_tps": 30_000.0,
        "decode_tps": 10_000.0,
        "device_free_bytes": 16 * GiB,
        "device_total_bytes": 24 * GiB,
        "parallel": 4,
    }
    fields.update(live)
    return BranchState(**fields)  # type: ignore[arg-type]


def _deadline(ms: float) -> object:
    return parse_requirement("fast", None, str(ms), None, S)


def test_the_deadline_filter_predicts_with_observed_speed_once_there_is_some() -> None:
    fast_by_profile = _branch("q4_k_m")
    (row,) = evaluate(_deadline(50), SHAPE, [fast_by_profile])  # type: ignore[arg-type]
    assert not row[0] & DEADLINE and row[3] == pytest.approx(1000 * (64 / 30_000 + 65 / 10_000))
    # end to end the branch answered in 20 ms to the first token, then 2 ms a token
    seen = replace(fast_by_profile, observed_ttft_ms=20.0, observed_tpot_ms=2.0)
    (row,) = evaluate(_deadline(50), SHAPE, [seen])  # type: ignore[arg-type]
    assert row[0] & DEADLINE and row[3] == pytest.approx(20.0 + 64 * 2.0)
    (row,) = evaluate(_deadline(200), SHAPE, [seen])  # type: ignore[arg-type]
    assert not row[0] & DEADLINE
    # only a first token seen so far (1-token answers): the profile's decode fills in
    first_only = replace(fast_by_profile, observed_ttft_ms=20.0)
    (row,) = evaluate(_deadline(50), SHAPE, [first_only])  # type: ignore[arg-type]
    assert row[3] == pytest.approx(20.0 + 64 * 0.1)


def test_a_slow_burst_moves_the_estimate_and_fast_requests_bring_it_back() -> None:
    speeds = ObservedSpeeds(weight=0.2, max_age_s=60.0)
    t = 1000.0
    for _ in range(10):
        speeds.observe("m:q8_0", 0.010, 65, 0.064, now=t)  # 10 ms + 1 ms a token
    calm = speeds.get("m:q8_0", now=t)
    assert calm is not None and calm.samples == 10
    assert calm.ttft_ms == pytest.approx(10.0) and calm.tpot_ms == pytest.approx(1.0)
    assert calm.decode_tps == pytest.approx(1000.0)
    for _ in range(5):  # a burst: 100 ms to the first token, 10 ms a token
        speeds.observe("m:q8_0", 0.100, 65, 0.640, now=t)
    slow = speeds.get("m:q8_0", now=t)
    assert slow is not None and slow.ttft_ms > 60.0 and slow.tpot_ms > 6.0  # type: ignore[operator]
    for _ in range(25):
        speeds.observe("m:q8_0", 0.010, 65, 0.064, now=t)
    back = speeds.get("m:q8_0", now=t)
    assert back is not None and back.ttft_ms < 11.0 and back.tpot_ms < 1.1  # type: ignore[operator]
    # a single-token answer teaches the first token only
    speeds.observe("m:q8_0", 0.010, 1, 0.0, now=t)
    assert speeds.get("m:q8_0", now=t).tpot_ms == back.tpot_ms  # type: ignore[union-attr]
    # no request for max_age_s: back to the profile (None), so a shunned branch gets traffic
    assert speeds.get("m:q8_0", now=t + 61.0) is None
    speeds.forget("m:q8_0")
    assert speeds.get("m:q8_0", now=t) is None


def test_routing_moves_off_a_branch_a_slow_burst_made_late_and_back_when_it_recovers() -> None:
    deadline = _deadline(60)
    speeds = ObservedSpeeds(weight=0.5)

    def states() -> list[BranchState]:
        out = []
        for name in ("q8_0", "q4_k_m"):
            got = speeds.get(f"m:{name}")
            seen = {} if got is None else {"observed_ttft_ms": got.ttft_ms}
            if got is not None:
                seen["observed_tpot_ms"] = got.tpot_ms  # type: ignore[assignment]
            # q8_0 is the more faithful: it wins while both meet the deadline
            out.append(_branch(name, **seen))
        return out

    assert choose("m", deadline, SHAPE, states(), S).primary == "m:q8_0"  # type: ignore[arg-type]
    for _ in range(4):
        speeds.observe("m:q8_0", 0.030, 65, 0.320)  # 30 ms + 5 ms a token: 350 ms
        speeds.observe("m:q4_k_m", 0.005, 65, 0.032)  # 5 ms + 0.5 ms a token: 37 ms
    late = choose("m", deadline, SHAPE, states(), S)  # type: ignore[arg-type]
    assert late.branch_ids == ("m:q4_k_m",)
    why = {e.branch_id: e for e in late.explanations}["m:q8_0"]
    assert "observed speed" in next(f.reason for f in why.filters if f.name == "deadline")
    for _ in range(8):
        speeds.observe("m:q8_0", 0.005, 65, 0.032)
    assert choose("m", deadline, SHAPE, states(), S).primary == "m:q8_0"  # type: ignore[arg-type]


async def test_a_served_request_feeds_the_branch_speed_shown_in_models_and_metrics() -> None:
    app = fake_app()
    async with serving(app) as (client, gateway):
        engine = gateway.routes.current.models["tiny-llama"].branches[2].engine
        assert isinstance(engine, FakeEngine)
        before = (await client.get("/v1/models")).json()["data"][0]["branches"]
        assert all(b["observed_speed"] is None for b in before)
        t0 = time.monotonic()
        r = await client.post(
            "/v1/completions",
            json={"model": "tiny-llama:q4_k_m", "prompt": "hello", "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        elapsed_ms = 1000 * (time.monotonic() - t0)
        entry = {
            b["branch"]: b for b in (await client.get("/v1/models")).json()["data"][0]["branches"]
        }
        seen = entry["q4_k_m"]["observed_speed"]
        assert seen["samples"] == 1 and 0 < seen["ttft_ms"] <= elapsed_ms
        assert seen["decode_tps"] is None or seen["decode_tps"] > 0
        assert entry["f16"]["observed_speed"] is None
        states = {s.name: s for s in gateway.states.read("tiny-llama")}
        assert states["q4_k_m"].observed_ttft_ms == pytest.approx(seen["ttft_ms"], abs=1e-3)
        assert states["f16"].observed_ttft_ms is None
        metrics = await client.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert metrics.status_code == 200
        lines = [
            line
            for line in metrics.text.splitlines()
            if line.startswith("quantroute_branch_observed_ttft_seconds{")
        ]
        assert len(lines) == 1 and 'branch="q4_k_m"' in lines[0]


# Two branches with observed speeds, for SHAPE: q8_0 predicted 42 ms, spread widely (two
# deviations: 48.4 ms either way); q4_k_m predicted 33.6 ms, steady (two deviations: 14.8 ms).
SHAKY = _branch(
    "q8_0",
    observed_ttft_ms=10.0,
    observed_tpot_ms=0.5,
    observed_ttft_dev_ms=5.0,
    observed_tpot_dev_ms=0.3,
)
STEADY = _branch(
    "q4_k_m",
    observed_ttft_ms=8.0,
    observed_tpot_ms=0.4,
    observed_ttft_dev_ms=1.0,
    observed_tpot_dev_ms=0.1,
)


def test_with_a_deadline_a_branch_in_time_only_on_average_gives_way_to_one_with_a_margin() -> None:
    # q8_0 (the more faithful: first by score) is in time on average but spreads widely;
    # q4_k_m is in time with room to spare
    states = (SHAKY, STEADY)
    margin = S.model_copy(update={"speeds": S.speeds.model_copy(update={"margin_deviations": 2})})
    d = choose("m", _deadline(60), SHAPE, states, margin)  # type: ignore[arg-type]
    assert d.branch_ids == ("m:q4_k_m", "m:q8_0") and d.reason == "shifted:margin"
    assert choose("m", _deadline(60), SHAPE, list(states), margin).branch_ids == d.branch_ids  # type: ignore[arg-type]
    # no margin asked, a deadline both meet with it, or none: the score's order
    no_margin = S.model_copy(
        update={"speeds": S.speeds.model_copy(update={"margin_deviations": 0})}
    )
    assert choose("m", _deadline(60), SHAPE, states, no_margin).primary == "m:q8_0"  # type: ignore[arg-type]
    assert choose("m", _deadline(120), SHAPE, states, S).primary == "m:q8_0"  # type: ignore[arg-type]
    assert choose("m", _deadline(40), SHAPE, states, S).primary == "m:q4_k_m"  # type: ignore[arg-type]
    tight = choose("m", _deadline(45), SHAPE, states, S)  # type: ignore[arg-type]
    assert tight.branch_ids == ("m:q8_0", "m:q4_k_m")  # neither has the margin: by score


def test_the_spread_is_learned_and_shrinks_when_requests_steady() -> None:
    speeds = ObservedSpeeds(weight=0.2)
    speeds.observe("b", 0.010, 65, 0.064, now=0.0)
    first = speeds.get("b", now=0.0)
    assert first is not None and first.ttft_dev_ms == pytest.approx(5.0)
    for i in range(40):
        speeds.observe("b", 0.010 if i % 2 else 0.030, 65, 0.064, now=0.0)
    wide = speeds.get("b", now=0.0)
    assert wide is not None and wide.ttft_dev_ms > 7.0
    for _ in range(40):
        speeds.observe("b", 0.020, 65, 0.064, now=0.0)
    narrow = speeds.get("b", now=0.0)
    assert narrow is not None and narrow.ttft_dev_ms < 0.2 and narrow.tpot_dev_ms < 0.01


def test_a_long_prompt_is_never_predicted_sooner_than_the_profile_prefills_it() -> None:
    # short prompts taught the branch 20 ms to a first token; a 30k-token prompt takes
    # the engine alone 1 s to prefill (30k tok/s), whatever the average says
    seen = _branch("q4_k_m", observed_ttft_ms=20.0, observed_tpot_ms=2.0)
    long = RequestShape(prompt_tokens=30_000, max_tokens=11)
    (row,) = evaluate(_deadline(500), long, [seen])  # type: ignore[arg-type]
    assert row[0] & DEADLINE and row[3] == pytest.approx(1000.0 + 10 * 2.0)
    (row,) = evaluate(_deadline(500), SHAPE, [seen])  # type: ignore[arg-type]
    assert not row[0] & DEADLINE and row[3] == pytest.approx(20.0 + 64 * 2.0)


def test_the_first_token_is_timed_from_the_engine_held_or_fallen_back_answers_teach_nothing() -> (
    None
):
    now = time.perf_counter()
    # arrived 1 s ago, waited 0.9 s in the admission queue, first token 0.05 s after the
    # engine got it, then 11 more tokens in 0.05 s
    trace = SimpleNamespace(t0=now - 1.0, ttft_s=0.95, fallbacks=[])
    speeds = ObservedSpeeds()
    got = observe_finished(speeds, "m:q8_0", trace, 12, opened=now - 0.1)
    assert got is not None
    assert got.ttft_ms == pytest.approx(50.0, abs=5.0)  # not 950: the queue is not in it
    assert got.tpot_ms == pytest.approx(50.0 / 11, rel=0.2)
    # held for a slow reader: its decode time is the reader's; fell back: the first token
    # waited for another branch's failure
    assert observe_finished(speeds, "m:q8_0", trace, 12, opened=now - 0.1, held=True) is None
    fell_back = SimpleNamespace(t0=now - 1.0, ttft_s=0.95, fallbacks=[("a", "b", "crash")])
    assert observe_finished(speeds, "m:q8_0", fell_back, 12, opened=now - 0.1) is None
    assert speeds.get("m:q8_0") == got  # unchanged by either


async def test_a_request_a_replaced_worker_finishes_does_not_feed_its_successor() -> None:
    app = fake_app()
    async with serving(app) as (client, gateway):
        r = await client.post(
            "/v1/completions",
            json={"model": "tiny-llama:q4_k_m", "prompt": "hello", "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        before = gateway.states.speeds.get("tiny-llama:q4_k_m")
        assert before is not None and before.samples == 1
        branch = gateway.routes.current.models["tiny-llama"].branch("q4_k_m")
        assert branch is not None
        retired = replace(branch, engine=FakeEngine("retired"))  # what a reload replaced
        trace = SimpleNamespace(t0=time.perf_counter() - 5.0, ttft_s=4.0, fallbacks=[])
        job = SimpleNamespace(trace=trace, requests=[SimpleNamespace(prompt_ids=[1])])
        run = SimpleNamespace(branch=retired, job=job, opened=None, held=False)
        gateway.finished(run, [1, 2, 3])  # type: ignore[arg-type]
        assert gateway.states.speeds.get("tiny-llama:q4_k_m") == before
        run.branch = branch  # the same request on the worker serving now: it counts
        gateway.finished(run, [1, 2, 3])  # type: ignore[arg-type]
        after = gateway.states.speeds.get("tiny-llama:q4_k_m")
        assert after is not None and after.samples == 2


def _balanced(ms: float) -> object:
    return parse_requirement("balanced", None, str(ms), None, S)


def test_with_nothing_in_time_a_branch_late_only_on_average_is_tried_not_refused() -> None:
    from quantroute.errors import ServiceUnavailableError

    shaky, steady = SHAKY, STEADY
    states = (shaky, steady)
    # both late on average for 30 ms, both within reach: tried, fastest predicted first
    d = choose("m", _balanced(30), SHAPE, states, S)  # type: ignore[arg-type]
    assert d.branch_ids == ("m:q4_k_m", "m:q8_0") and d.reason == "deadline:within-reach"
    why = {e.branch_id: e for e in d.explanations}
    assert not next(f.passed for f in why["m:q8_0"].filters if f.name == "deadline")
    # 10 ms: only the widely spread q8_0 may still make it
    assert choose("m", _balanced(10), SHAPE, states, S).branch_ids == ("m:q8_0",)  # type: ignore[arg-type]
    # out of reach for both (q8_0 by its profile: the engine alone needs 8.6 ms): a 503
    with pytest.raises(ServiceUnavailableError, match="too slow for the deadline"):
        choose("m", _balanced(1), SHAPE, states, S)  # type: ignore[arg-type]
    # the setting at 0: a predicted miss is a 503
    off = S.model_copy(update={"speeds": S.speeds.model_copy(update={"reach_deviations": 0})})
    with pytest.raises(ServiceUnavailableError):
        choose("m", _balanced(30), SHAPE, states, off)  # type: ignore[arg-type]
    # fast: the branches within reach first, then the rest of its best effort (here an f16
    # with no room on its device) as fallbacks; balanced never gets the f16 that way
    full = _branch("f16", kv_bytes_per_token=1024, device_free_bytes=0)
    slower = replace(steady, observed_ttft_ms=12.0)  # predicted 37.6 ms, soonest 22.8 ms
    fast = choose("m", _deadline(30), SHAPE, (full, shaky, slower), S)  # type: ignore[arg-type]
    assert fast.reason == "deadline:within-reach"
    assert fast.branch_ids == ("m:q4_k_m", "m:q8_0", "m:f16")
    bal = choose("m", _balanced(30), SHAPE, (full, shaky, slower), S)  # type: ignore[arg-type]
    assert bal.branch_ids == ("m:q4_k_m", "m:q8_0")


def test_only_a_branch_that_fails_the_deadline_alone_and_has_observations_is_in_reach() -> None:
    from quantroute.errors import ServiceUnavailableError

    seen = {"observed_ttft_ms": 8.0, "observed_tpot_ms": 0.4, "observed_ttft_dev_ms": 1.0,
            "observed_tpot_dev_ms": 0.1}  # fmt: skip
    profiled = _branch("q4_k_m")  # the profile's 8.6 ms, no spread known
    full = _branch("q8_0", kv_bytes_per_token=1024, device_free_bytes=0, **seen)  # no room
    not_ready = _branch("q8_0", ready=False, **seen)
    for states in ((profiled,), (full,), (not_ready,)):
        with pytest.raises(ServiceUnavailableError):
            choose("m", _balanced(5 if states == (profiled,) else 30), SHAPE, states, S)  # type: ignore[arg-type]
    # a quality bound is never relaxed: q4_k_m profiled past balanced's bound stays out
    coarse = _branch("q4_k_m", mean_kld=0.5, **seen)
    with pytest.raises(ServiceUnavailableError):
        choose("m", _balanced(30), SHAPE, (coarse,), S)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    samples=st.lists(
        st.tuples(
            st.floats(0.001, 0.2),  # seconds to the first token
            st.integers(1, 80),  # tokens
            st.floats(0.0, 1.0),  # decode seconds
            st.floats(0.0, 20.0),  # seconds since the last request
        ),
        min_size=1,
        max_size=60,
    )
)
def test_routing_reads_each_estimate_in_steps_within_a_sixteenth_of_it(
    samples: list[tuple[float, int, float, float]],
) -> None:
    """The table routing reads holds an entry while every figure stays within ``STEP`` of
    its mean from the estimate (``get``), and not past ``max_age_s / 8``; it is replaced,
    by the estimate itself, as soon as one would not. Fails when a step is missed."""
    speeds = ObservedSpeeds(weight=0.2, max_age_s=60.0)
    table, _ = speeds.table()
    now, published = 0.0, 0
    for ttft_s, tokens, decode_s, gap in samples:
        now += gap
        before = table.get("b")
        exact = speeds.observe("b", ttft_s, tokens, decode_s, now=now)
        shown = table["b"]
        if shown is not before:
            published += 1
            assert shown is exact  # a new entry is the estimate, as it is now
        assert now - shown.at <= 60.0 / 8
        assert abs(shown.ttft_ms - exact.ttft_ms) <= STEP * shown.ttft_ms
        assert abs(shown.ttft_dev_ms - exact.ttft_dev_ms) <= STEP * shown.ttft_ms
        assert (shown.tpot_ms is None) == (exact.tpot_ms is None)
        if shown.tpot_ms is not None and exact.tpot_ms is not None:
            assert abs(shown.tpot_ms - exact.tpot_ms) <= STEP * shown.tpot_ms
            assert abs(shown.tpot_dev_ms - exact.tpot_dev_ms) <= STEP * shown.tpot_ms
    speeds.forget("b")
    assert "b" not in table


def test_steady_requests_leave_the_routing_entry_as_it_is() -> None:
    """Requests as fast as the estimate says move it by less than a step: the entry (and
    so the branch's routing record) stays the same object, where the estimate is a new
    one per request."""
    speeds = ObservedSpeeds(weight=0.2, max_age_s=60.0)
    table, _ = speeds.table()
    for i in range(20):
        speeds.observe("b", 0.010, 65, 0.064, now=i * 0.1)
    first = table["b"]
    for i in range(20, 50):  # 3 % either side of the mean
        speeds.observe("b", 0.0103 if i % 2 else 0.0097, 65, 0.064, now=i * 0.1)
    assert table["b"] is first and speeds.get("b", now=5.0) is not first
    speeds.observe("b", 0.050, 65, 0.064, now=5.0)  # a slow one moves the mean 80 %
    assert table["b"] is not first and table["b"].ttft_ms > 15.0


def test_the_routing_entry_is_renewed_within_an_eighth_of_max_age() -> None:
    """Identical requests never move the estimate, but its entry is renewed after
    ``max_age_s / 8``, so it does not age out while requests keep coming."""
    speeds = ObservedSpeeds(weight=0.2, max_age_s=60.0)
    table, _ = speeds.table()
    for _ in range(60):  # the spread, half the first sample at first, decays to nothing
        speeds.observe("b", 0.010, 65, 0.064, now=0.0)
    first = table["b"]
    for t in range(1, 8):
        speeds.observe("b", 0.010, 65, 0.064, now=float(t))
    assert table["b"] is first  # 7 s: under 7.5
    speeds.observe("b", 0.010, 65, 0.064, now=8.0)
    assert table["b"] is not first and table["b"].at == 8.0

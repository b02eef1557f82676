"""KLD / top-1 / PPL math against independent, loop-by-loop float64 references."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from quantroute.quality.metrics import (
    KldAccumulator,
    QualityStats,
    kl_divergence,
    log_softmax,
    percentile,
    summarize,
    token_logprob,
    top1_agreement,
)

INF = math.inf


# ---- references, written the slow way ---------------------------------------------------


def ref_log_softmax_row(row: list[float]) -> list[float]:
    finite = [x for x in row if x != -INF]
    m = max(finite)
    total = math.fsum(math.exp(x - m) for x in finite)
    return [x - m - math.log(total) if x != -INF else -INF for x in row]


def ref_kl_row(ref_lp: list[float], q_lp: list[float]) -> float:
    terms = []
    for a, b in zip(ref_lp, q_lp, strict=True):
        if a == -INF:
            continue  # 0 * log 0 = 0
        if b == -INF:
            return INF
        terms.append(math.exp(a) * (a - b))
    return max(0.0, math.fsum(terms))


def ref_argmax(row: list[float]) -> int:
    best = 0
    for i, x in enumerate(row):
        if x > row[best]:
            best = i
    return best


def llama_cpp_stats(kld: list[float], nll_q: list[float], nll_b: list[float], same: list[bool]):
    """perplexity.cpp's one-pass sums, transcribed."""
    n = len(kld)

    def mean_unc(s: float, s2: float) -> tuple[float, float]:
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    def pct(values: list[float], fraction: float) -> float:
        v = sorted(values)
        p = fraction * (len(v) - 1)
        ip = int(p)
        p -= ip
        return (1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)]

    lq = mean_unc(sum(nll_q), sum(x * x for x in nll_q))
    lb = mean_unc(sum(nll_b), sum(x * x for x in nll_b))
    cov = (sum(a * b for a, b in zip(nll_q, nll_b, strict=True)) / n - lq[0] * lb[0]) / (n - 1)
    dp = [math.exp(-a) - math.exp(-b) for a, b in zip(nll_q, nll_b, strict=True)]
    msd = mean_unc(sum(d * d for d in dp), sum(d**4 for d in dp))
    p_top = sum(same) / n
    return {
        "mean_kld": mean_unc(sum(kld), sum(k * k for k in kld)),
        "median": statistics.median(kld),
        "p90": pct(kld, 0.9),
        "p99": pct(kld, 0.99),
        "p999": pct(kld, 0.999),
        "max": max(kld),
        "ppl_q": math.exp(lq[0]),
        "ppl_ref": math.exp(lb[0]),
        "ratio": (lq[0] - lb[0], math.sqrt(lq[1] ** 2 + lb[1] ** 2 - 2 * cov)),
        "rms_dp": math.sqrt(msd[0]),
        "rms_dp_unc": 0.5 / math.sqrt(msd[0]) * msd[1],
        "top1": (p_top, math.sqrt(p_top * (1 - p_top) / (n - 1))),
    }


def random_pair(rng: np.random.Generator, t: int, v: int, noise: float = 0.3):
    ref = rng.normal(0.0, 3.0, size=(t, v))
    q = ref + rng.normal(0.0, noise, size=(t, v))
    return ref, q


# ---- log_softmax ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_softmax_matches_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 5, size=(6, 11)).astype(np.float32)
    got = log_softmax(logits)
    assert got.dtype == np.float64
    for row, out in zip(logits.astype(np.float64).tolist(), got, strict=True):
        np.testing.assert_allclose(out, ref_log_softmax_row(row), rtol=1e-13, atol=1e-13)


def test_log_softmax_peaked_and_neg_inf() -> None:
    got = log_softmax(np.array([[0.0, -1e4, 1e4], [-INF, 3.0, -INF]]))
    assert got[0].tolist() == [-1e4, -2e4, 0.0]
    assert got[1].tolist() == [-INF, 0.0, -INF]
    # a 1-D row works too and sums to one
    assert math.isclose(float(np.exp(log_softmax(np.arange(5.0))).sum()), 1.0, rel_tol=1e-15)


@pytest.mark.parametrize("bad", [[[0.0, math.nan]], [[0.0, INF]], [[-INF, -INF]], np.zeros((2, 0))])
def test_log_softmax_rejects_non_distributions(bad: object) -> None:
    with pytest.raises(ValueError):
        log_softmax(np.asarray(bad, dtype=np.float64))


# ---- per-token KLD, top-1, token log-prob ------------------------------------------------------


def test_kl_divergence_known_value() -> None:
    ref = np.log([[0.5, 0.5]])
    q = np.log([[0.25, 0.75]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert math.isclose(float(kl_divergence(ref, q)[0]), expected, rel_tol=1e-14)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("noise", [1e-3, 0.3, 3.0])
def test_kl_divergence_matches_loop_reference(seed: int, noise: float) -> None:
    rng = np.random.default_rng(seed)
    ref_logits, q_logits = random_pair(rng, 5, 9, noise)
    ref, q = log_softmax(ref_logits), log_softmax(q_logits)
    got = kl_divergence(ref, q)
    assert got.shape == (5,)
    for t in range(5):
        r_lp = ref_log_softmax_row(ref_logits[t].tolist())
        q_lp = ref_log_softmax_row(q_logits[t].tolist())
        assert math.isclose(got[t], ref_kl_row(r_lp, q_lp), rel_tol=1e-9, abs_tol=1e-15)


def test_identical_distributions_give_exactly_zero() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 10, size=(20, 50))
    logits[3, :10] = -INF
    logits[4, 1] = 1e4
    lp = log_softmax(logits)
    assert np.all(kl_divergence(lp, lp) == 0.0)
    acc = KldAccumulator()
    acc.add(lp, lp, rng.integers(10, 50, size=20))
    stats = acc.result()
    assert stats.mean_kld == 0.0 and stats.kld_max == 0.0 and stats.kld_p999 == 0.0
    assert stats.top1 == 1.0 and stats.top1_sigma == 0.0
    assert stats.ln_ppl_ratio == 0.0 and stats.ln_ppl_ratio_stderr == 0.0
    assert stats.rms_dp == 0.0 and stats.ppl_q == stats.ppl_ref


def test_peaked_distributions_1e4_apart() -> None:
    ref = log_softmax(np.array([[0.0, -1e4, -1e4], [0.0, -1e4, -1e4]]))
    q = log_softmax(np.array([[-1e4, 0.0, -1e4], [0.0, -2e4, -1e4]]))
    got = kl_divergence(ref, q)
    # row 0: all reference mass on token 0, which q gives log-prob -1e4
    assert math.isclose(got[0], 1e4, rel_tol=1e-12)
    # row 1: q agrees on the peak; the difference lives in e^-1e4 mass, i.e. 0
    assert got[1] == 0.0
    assert top1_agreement(ref, q).tolist() == [False, True]


def test_neg_inf_in_either_distribution() -> None:
    ref_logits = np.array(
        [
            [1.0, -INF, 0.5, 0.0],  # ref has no mass on token 1: q's mass there is free
            [1.0, 0.0, 0.5, 0.0],  # q has no mass on token 1: infinite divergence
            [1.0, -INF, 0.5, 0.0],  # both have none on token 1: finite
            [1.0, -800.0, 0.0, 0.0],  # ref mass e^-800 underflows, but q's -inf still is inf
        ]
    )
    q_logits = np.array(
        [
            [0.0, 2.0, 0.5, 1.0],
            [1.0, -INF, 0.5, 0.0],
            [0.2, -INF, 0.5, 0.9],
            [1.0, -INF, 0.0, 0.0],
        ]
    )
    ref, q = log_softmax(ref_logits), log_softmax(q_logits)
    got = kl_divergence(ref, q)
    expected = [
        ref_kl_row(ref_log_softmax_row(r.tolist()), ref_log_softmax_row(s.tolist()))
        for r, s in zip(ref_logits, q_logits, strict=True)
    ]
    assert math.isfinite(got[0]) and math.isclose(got[0], expected[0], rel_tol=1e-12)
    assert got[1] == INF == expected[1]
    assert math.isfinite(got[2]) and math.isclose(got[2], expected[2], rel_tol=1e-12)
    assert got[3] == INF == expected[3]


def test_top1_ties_go_to_lowest_id_in_each_distribution() -> None:
    ref = np.array([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    q = np.array([[0.0, 1.0, 0.5], [1.0, 3.0, 0.0], [-INF, 0.0, 0.0]])
    assert top1_agreement(ref, q).tolist() == [True, False, False]
    for r, s, same in zip(ref, q, top1_agreement(ref, q), strict=True):
        assert same == (ref_argmax(r.tolist()) == ref_argmax(s.tolist()))


def test_token_logprob_picks_targets_and_checks_bounds() -> None:
    lp = log_softmax(np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]))
    got = token_logprob(lp, np.array([2, 1]))
    assert got.tolist() == [lp[0, 2], lp[1, 1]]
    with pytest.raises(ValueError):
        token_logprob(lp, np.array([0, 3]))
    with pytest.raises(ValueError):
        token_logprob(lp, np.array([0.0, 1.0]))
    with pytest.raises(ValueError):
        kl_divergence(lp, lp[:1])


# ---- aggregated statistics ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [11, 200, 1001])
def test_summary_matches_llama_cpp_formulas(n: int) -> None:
    rng = np.random.default_rng(n)
    ref_logits, q_logits = random_pair(rng, n, 13, noise=0.5)
    targets = rng.integers(0, 13, size=n)
    ref, q = log_softmax(ref_logits), log_softmax(q_logits)
    acc = KldAccumulator()
    acc.add(ref, q, targets)
    s = acc.result()

    kld = [ref_kl_row(r.tolist(), x.tolist()) for r, x in zip(ref, q, strict=True)]
    nll_q = [-float(q[t, targets[t]]) for t in range(n)]
    nll_b = [-float(ref[t, targets[t]]) for t in range(n)]
    same = [ref_argmax(r.tolist()) == ref_argmax(x.tolist()) for r, x in zip(ref, q, strict=True)]
    want = llama_cpp_stats(kld, nll_q, nll_b, same)

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-12)

    assert s.n_tokens == n
    assert close(s.mean_kld, want["mean_kld"][0]) and close(s.kld_stderr, want["mean_kld"][1])
    assert close(s.kld_median, want["median"]) and close(s.kld_p90, want["p90"])
    assert close(s.kld_p99, want["p99"]) and close(s.kld_p999, want["p999"])
    assert s.kld_max == pytest.approx(want["max"], rel=1e-12)
    assert close(s.ppl_q, want["ppl_q"]) and close(s.ppl_ref, want["ppl_ref"])
    assert close(s.ln_ppl_ratio, want["ratio"][0])
    assert close(s.ln_ppl_ratio_stderr, want["ratio"][1])
    assert close(s.rms_dp, want["rms_dp"]) and close(s.rms_dp_stderr, want["rms_dp_unc"])
    assert close(s.top1, want["top1"][0]) and close(s.top1_sigma, want["top1"][1])
    assert 0.0 < s.top1 < 1.0 and s.mean_kld > 0.0


def test_stderr_is_zero_for_ten_tokens_or_fewer_like_llama_cpp() -> None:
    s = summarize([0.1, 0.2, 0.3] * 3, [1.0] * 9, [1.1] * 9, [True, False, True] * 3)
    assert s.kld_stderr == 0.0 and s.mean_kld == pytest.approx(0.2)
    assert s.top1_sigma == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 8))
    one = summarize([0.5], [1.0], [1.0], [True])
    assert one.top1_sigma == 0.0 and one.kld_median == 0.5


def test_infinite_kld_is_reported_not_nan() -> None:
    kld = [0.01] * 99 + [INF]
    s = summarize(kld, [1.0] * 100, [1.0] * 100, [True] * 100)
    assert s.mean_kld == INF and s.kld_stderr == INF and s.kld_max == INF
    assert s.kld_median == pytest.approx(0.01) and s.kld_p90 == pytest.approx(0.01)
    assert s.kld_p99 == INF  # rank 98.01 lies between 0.01 and inf
    assert not any(math.isnan(getattr(s, f)) for f in QualityStats.__dataclass_fields__)
    # the branch gave the correct token probability 0: PPL(Q) is infinite
    s2 = summarize([0.0, 1.0], [INF, 1.0], [1.0, 1.0], [True, True])
    assert s2.ppl_q == INF and s2.ln_ppl_ratio == INF and math.isfinite(s2.ppl_ref)
    assert s2.rms_dp == pytest.approx(math.sqrt(math.exp(-2.0) / 2))


def test_percentile_interpolates_and_keeps_ends() -> None:
    v = np.array([0.0, 1.0, 2.0, 10.0])
    assert percentile(v, 0.0) == 0.0 and percentile(v, 1.0) == 10.0
    assert percentile(v, 0.5) == 1.5
    assert percentile(v, 0.9) == pytest.approx(2.0 + 0.7 * 8.0)
    assert percentile(np.array([1.0, INF]), 0.5) == INF
    with pytest.raises(ValueError):
        percentile(np.array([]), 0.5)


def test_empty_accumulator_refuses_to_summarize() -> None:
    acc = KldAccumulator()
    assert acc.n_tokens == 0
    with pytest.raises(ValueError):
        acc.result()


# ---- streaming ---------------------------------------------------------------------------------


def test_large_vocabulary_in_chunks_equals_all_at_once() -> None:
    rng = np.random.default_rng(150)
    t, v = 40, 150_000
    ref_logits = rng.normal(0, 4, size=(t, v)).astype(np.float32)  # [T, V]
    q_logits = (ref_logits + rng.normal(0, 0.2, size=(t, v))).astype(np.float32)  # [T, V]
    q_logits[5, :1000] = -np.inf
    targets = rng.integers(0, v, size=t)

    whole = KldAccumulator()
    whole.add(log_softmax(ref_logits), log_softmax(q_logits), targets)
    chunked = KldAccumulator()
    for lo, hi in [(0, 1), (1, 7), (7, 25), (25, 40)]:
        chunked.add_logits(ref_logits[lo:hi], q_logits[lo:hi], targets[lo:hi])
    assert chunked.n_tokens == whole.n_tokens == t
    a, b = whole.result(), chunked.result()
    for name in QualityStats.__dataclass_fields__:
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-15), name
    np.testing.assert_allclose(whole.per_token_kld(), chunked.per_token_kld(), rtol=1e-12)

    # and both agree with a slow, exact per-row reference on a few rows
    ref64, q64 = ref_logits.astype(np.float64), q_logits.astype(np.float64)
    for row in (0, 5, 39):
        r_lp = ref_log_softmax_row(ref64[row].tolist())
        q_lp = ref_log_softmax_row(q64[row].tolist())
        assert math.isclose(whole.per_token_kld()[row], ref_kl_row(r_lp, q_lp), rel_tol=1e-9)


def test_bad_input_is_refused_and_leaves_the_accumulator_unchanged() -> None:
    acc = KldAccumulator()
    with pytest.raises(ValueError):
        acc.add_logits(np.zeros((3, 4)), np.zeros((3, 4)), np.zeros(2, dtype=int))
    lp = log_softmax(np.zeros((3, 4)))
    with pytest.raises(ValueError):
        acc.add(lp, lp, np.array([0, 1, 4]))  # token 4 is outside the vocabulary
    assert acc.n_tokens == 0
    acc.add(lp, lp, np.array([0, 1, 3]))
    assert acc.n_tokens == 3 and acc.result().n_tokens == 3

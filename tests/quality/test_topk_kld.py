"""KL divergence and top-1 agreement from listed (top-k) tokens: ``divergence``'s top-k
estimator is a lower bound of the full KLD, exact where it should be, and refuses rows
that are not distributions."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantroute.divergence import (
    TAIL_FLOOR,
    TopK,
    kl_divergence,
    kl_divergence_topk,
    log_softmax,
    tail_mass_topk,
    token_logprob,
    token_logprob_topk,
    top1_agreement,
    top1_agreement_topk,
    top_k,
)
from quantroute.quality.metrics import KldAccumulator

F64 = npt.NDArray[np.float64]
TOL = 1e-10  # float64 rounding of sums over a few hundred terms


def pair(seed: int, rows: int, vocab: int, spread: float, noise: float) -> tuple[F64, F64]:
    """A reference and a perturbed branch, ``[rows, vocab]`` log-probabilities each."""
    rng = np.random.default_rng(seed)
    ref = log_softmax(rng.normal(size=(rows, vocab)) * spread)
    q = log_softmax(ref + rng.normal(size=(rows, vocab)) * noise)
    return ref, q


Case = tuple[int, int, int, float, float, int]
cases = st.tuples(
    st.integers(0, 2**32 - 1),  # seed
    st.integers(1, 8),  # rows
    st.integers(2, 80),  # vocabulary
    st.floats(0.1, 6.0),  # how peaked the reference is
    st.floats(0.0, 3.0),  # how far the branch is from it
    st.integers(1, 20),  # k
)


@settings(max_examples=300, deadline=None)
@given(cases)
def test_the_estimate_never_exceeds_the_full_kld(
    case: Case,
) -> None:
    seed, rows, vocab, spread, noise, k = case
    ref, q = pair(seed, rows, vocab, spread, noise)
    full = kl_divergence(ref, q)
    targets = np.random.default_rng(seed + 1).integers(0, vocab, rows)
    for listed in (top_k(q, k), top_k(q, k, also=targets)):
        from_full_ref = kl_divergence_topk(ref, listed)
        from_listed_ref = kl_divergence_topk(top_k(ref, k), listed)
        assert (from_full_ref <= full + TOL).all()
        assert (from_listed_ref <= full + TOL).all()
        assert (from_full_ref >= 0).all() and (from_listed_ref >= 0).all()


@settings(max_examples=150, deadline=None)
@given(cases)
def test_more_listed_tokens_never_lower_the_estimate(
    case: Case,
) -> None:
    """Top-(k+1) refines top-k's partition; refining can only raise KL (data processing),
    while the branch's tail is above the floor (below it, rounding is all there is)."""
    seed, rows, vocab, spread, noise, _ = case
    ref, q = pair(seed, rows, vocab, spread, noise)
    previous = np.zeros(rows)
    for k in range(1, min(vocab, 20) + 1):
        listed = top_k(q, k)
        est = kl_divergence_topk(ref, listed)
        resolved = 1.0 - listed.listed_mass() >= TAIL_FLOOR
        assert (est[resolved] >= previous[resolved] - TOL).all(), k
        previous = est


@pytest.mark.parametrize("k", range(1, 21))
def test_k_from_1_to_20_on_a_wide_vocabulary(k: int) -> None:
    ref, q = pair(k, 32, 2000, 3.0, 0.4)
    full = kl_divergence(ref, q)
    est = kl_divergence_topk(ref, top_k(q, k))
    tail = tail_mass_topk(ref, top_k(q, k))
    assert (est <= full + TOL).all()
    assert (tail > 0).all() and (tail < 1).all()
    # the gap is the divergence inside the tail, weighted by its mass: P_rest · KL(tail)
    # is at most P_rest times the largest per-token log-ratio there
    ratio = np.where(np.exp(ref) > 0, ref - q, 0.0).max(axis=1)
    assert (full - est <= tail * np.maximum(ratio, 0) + 1e-9).all()
    assert (top1_agreement_topk(ref, top_k(q, k)) == top1_agreement(ref, q)).all()


def test_listing_every_token_is_the_full_kld() -> None:
    ref, q = pair(7, 16, 50, 2.0, 1.0)
    assert kl_divergence_topk(ref, top_k(q, 50)) == pytest.approx(kl_divergence(ref, q), abs=1e-12)
    listed_ref = kl_divergence_topk(top_k(ref, 50), top_k(q, 50))
    assert listed_ref == pytest.approx(kl_divergence(ref, q), abs=1e-12)
    assert tail_mass_topk(ref, top_k(q, 50)) == pytest.approx(0.0, abs=1e-12)


def test_identical_distributions_give_zero_at_any_k() -> None:
    ref, _ = pair(3, 8, 100, 3.0, 0.0)
    for k in (1, 5, 20):
        assert kl_divergence_topk(ref, top_k(ref, k)).max() == pytest.approx(0.0, abs=1e-12)
        assert kl_divergence_topk(top_k(ref, k), top_k(ref, k)).max() == pytest.approx(
            0.0, abs=1e-12
        )


def test_proportional_tails_are_exact() -> None:
    """When q's tail is p's scaled (q(v|rest) = p(v|rest)), nothing hides in the tail."""
    rng = np.random.default_rng(11)
    p = np.exp(log_softmax(rng.normal(size=(4, 60)) * 2))  # [4, 60]
    q = p.copy()
    head = np.argsort(-p, axis=1)[:, :5]  # [4, 5]
    rows = np.arange(4)[:, None]
    q[rows, head] = rng.dirichlet(np.ones(5), size=4) * 0.9  # the head moves; tail rescales
    tail = np.ones_like(p, dtype=bool)
    tail[rows, head] = False
    q[tail] = (p * tail / (p * tail).sum(axis=1, keepdims=True) * 0.1)[tail]
    lp, lq = np.log(p), np.log(q)
    listed = TopK(head, np.take_along_axis(lq, head, axis=1))
    assert kl_divergence_topk(lp, listed) == pytest.approx(kl_divergence(lp, lq), rel=1e-12)


def test_a_hand_computed_row() -> None:
    p = np.log([[0.5, 0.3, 0.2]])
    listed = TopK(np.array([[1]]), np.log([[0.4]]))  # q lists token 1 at 0.4
    expected = 0.3 * math.log(0.3 / 0.4) + 0.7 * math.log(0.7 / 0.6)
    assert kl_divergence_topk(p, listed)[0] == pytest.approx(expected, rel=1e-12)
    assert tail_mass_topk(p, listed)[0] == pytest.approx(0.7)
    assert not top1_agreement_topk(p, listed)[0]
    ref_listed = TopK(np.array([[0, 1]]), np.log([[0.5, 0.3]]))  # token 0 is q-unknown
    assert kl_divergence_topk(ref_listed, listed)[0] == pytest.approx(expected, rel=1e-12)


def test_a_listed_zero_where_the_reference_has_mass_is_infinite() -> None:
    p = np.log([[0.5, 0.5]])
    listed = TopK(np.array([[0, 1]]), np.array([[0.0, -np.inf]]))
    assert kl_divergence_topk(p, listed)[0] == math.inf


def test_a_listed_mass_that_rounds_past_one_leaves_a_floor_not_an_infinity() -> None:
    p = np.log([[0.6, 0.3, 0.1]])
    listed = TopK(np.array([[0, 1]]), np.log([[0.7, 0.3 + 2e-6]]))  # float32-ish rounding
    est = kl_divergence_topk(p, listed)[0]
    m = 0.6 * math.log(0.6 / 0.7) + 0.3 * math.log(0.3 / (0.3 + 2e-6))
    assert est == pytest.approx(max(0.0, m + 0.1 * math.log(0.1 / TAIL_FLOOR)), rel=1e-9)
    assert est <= kl_divergence(p, np.log([[0.7, 0.3 - 1e-9, 1e-9]]))[0]


def test_top_k_orders_by_probability_then_id_and_adds_missing_targets() -> None:
    lp = np.log([[0.1, 0.3, 0.3, 0.2, 0.1]])
    listed = top_k(lp, 3)
    assert listed.ids.tolist() == [[1, 2, 3]]
    with_target = top_k(lp, 3, also=np.array([4]))
    assert with_target.ids.tolist() == [[1, 2, 3, 4]]
    assert top_k(lp, 3, also=np.array([2])).ids.tolist() == [[1, 2, 3, -1]]
    assert top_k(lp, 9).ids.shape == (1, 5)  # k past the vocabulary: all of it
    assert listed.top1().tolist() == [1]


@settings(max_examples=100, deadline=None)
@given(cases)
def test_a_targets_logprob_is_exact_when_listed_and_an_upper_bound_when_not(
    case: Case,
) -> None:
    seed, rows, vocab, spread, noise, k = case
    _, q = pair(seed, rows, vocab, spread, noise)
    targets = np.random.default_rng(seed).integers(0, vocab, rows)
    truth = token_logprob(q, targets)
    assert token_logprob_topk(top_k(q, k, also=targets), targets) == pytest.approx(truth)
    assert (token_logprob_topk(top_k(q, k), targets) >= truth - TOL).all()


@settings(max_examples=100, deadline=None)
@given(cases)
def test_top1_from_lists_is_the_full_rows_top1(
    case: Case,
) -> None:
    seed, rows, vocab, spread, noise, k = case
    ref, q = pair(seed, rows, vocab, spread, noise)
    full = top1_agreement(ref, q)
    assert (top1_agreement_topk(ref, top_k(q, k)) == full).all()
    assert (top1_agreement_topk(top_k(ref, k), top_k(q, k)) == full).all()


@pytest.mark.parametrize(
    ("ids", "logprobs", "message"),
    [
        ([[0, 0]], [[-1.0, -2.0]], "twice"),
        ([[0, 1]], [[-1.0, math.nan]], "NaN"),
        ([[0, 1]], [[0.1, -2.0]], "above 0"),
        ([[0, 1, 2]], [[-1.0, -2.0]], "expected"),
        ([[0.5, 1]], [[-1.0, -2.0]], "integers"),
    ],
)
def test_listed_rows_that_are_not_distributions_are_refused(
    ids: list[list[float]], logprobs: list[list[float]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TopK(np.array(ids), np.array(logprobs))


def test_padding_and_float32_rounding_are_accepted() -> None:
    listed = TopK(np.array([[3, -1, -1]]), np.array([[4e-6, 7.0, math.nan]]))
    assert listed.logprobs.tolist() == [[0.0, -math.inf, -math.inf]]  # padding is ignored
    assert listed.top1().tolist() == [3]
    assert TopK(np.full((1, 2), -1), np.zeros((1, 2))).top1().tolist() == [-1]


def test_rows_must_match() -> None:
    ref, q = pair(1, 4, 30, 2.0, 1.0)
    with pytest.raises(ValueError, match="reference"):
        kl_divergence_topk(ref[:3], top_k(q, 5))
    with pytest.raises(ValueError, match="vocabulary"):
        kl_divergence_topk(ref[:, :10], top_k(q, 5))
    with pytest.raises(ValueError, match="rows"):
        kl_divergence_topk(top_k(ref[:3], 5), top_k(q, 5))


def test_the_accumulator_scores_listed_rows_like_full_ones_when_all_are_listed() -> None:
    ref, q = pair(5, 40, 60, 2.0, 0.8)
    targets = np.random.default_rng(5).integers(0, 60, 40)
    full, listed = KldAccumulator(), KldAccumulator()
    full.add(ref, q, targets)
    listed.add_topk(ref, top_k(q, 60), targets)
    a, b = full.result(), listed.result()
    assert b.mean_kld == pytest.approx(a.mean_kld, abs=1e-12)
    assert (b.top1, b.ppl_q, b.ppl_ref) == pytest.approx((a.top1, a.ppl_q, a.ppl_ref))
    assert listed.mean_tail_mass() == pytest.approx(0.0, abs=1e-12)

    truncated = KldAccumulator()
    truncated.add_topk_logits(ref * 3.0, top_k(log_softmax(q * 3.0), 5, also=targets), targets)
    exact = KldAccumulator()
    exact.add_logits(ref * 3.0, q * 3.0, targets)
    assert truncated.result().mean_kld <= exact.result().mean_kld + TOL
    assert truncated.result().ppl_q == pytest.approx(exact.result().ppl_q)  # targets listed
    assert truncated.result().top1 == exact.result().top1
    assert 0 < truncated.mean_tail_mass() < 1

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantroute.engines.sampling import GREEDY_BELOW, LOGPROB_FLOOR, log_softmax, sample


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_greedy_takes_the_argmax_and_reports_its_logprob() -> None:
    logits = np.array([0.0, 3.0, 1.0], dtype=np.float32)
    choice = sample(logits, temperature=0, top_p=1, top_k=0, rng=_rng(), want_logprob=True, n_top=2)
    assert choice.token == 1
    expected = 3.0 - math.log(math.exp(0) + math.exp(3) + math.exp(1))
    assert choice.logprob == pytest.approx(expected, rel=1e-6)
    assert [t for t, _ in choice.top] == [1, 2]


def test_log_softmax_handles_minus_infinity() -> None:
    row = log_softmax(np.array([-np.inf, 0.0, 0.0], dtype=np.float32))
    assert row[0] == -np.inf
    assert row[1] == pytest.approx(math.log(0.5))


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    logits = np.array([1.0, 2.0, 5.0, 0.0], dtype=np.float32)
    picks = {
        sample(logits, temperature=2.0, top_p=1, top_k=1, rng=_rng(s)).token for s in range(50)
    }
    assert picks == {2}


def test_top_p_keeps_only_the_nucleus() -> None:
    # probabilities ~ [0.665, 0.245, 0.09]: top_p 0.6 keeps the first token only.
    logits = np.log(np.array([0.665, 0.245, 0.09], dtype=np.float32))
    picks = {
        sample(logits, temperature=1.0, top_p=0.6, top_k=0, rng=_rng(s)).token for s in range(100)
    }
    assert picks == {0}
    picks = {
        sample(logits, temperature=1.0, top_p=0.95, top_k=0, rng=_rng(s)).token for s in range(300)
    }
    assert picks == {0, 1, 2}


def test_sampling_follows_the_distribution_and_the_seed() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    rng = _rng(7)
    draws = [sample(logits, temperature=1.0, top_p=1, top_k=0, rng=rng).token for _ in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.03)
    again = _rng(7)
    assert draws[:50] == [
        sample(logits, temperature=1.0, top_p=1, top_k=0, rng=again).token for _ in range(50)
    ]


# ---- totality: any admitted parameters, any row ------------------------------------------------

EDGE_TEMPERATURES = [0.0, 5e-324, 1e-320, 1e-310, 1e-308, GREEDY_BELOW, 1e-3, 1.0, 2.0]
F32_MAX = float(np.finfo(np.float32).max)


def _rows() -> st.SearchStrategy[npt.NDArray[Any]]:
    """Rows of logits as the worker sees them (float32) and wider ones (float64), with
    nan, both infinities, subnormals and values at the float32 limit."""
    edges = st.sampled_from([-np.inf, np.inf, np.nan, 0.0, -F32_MAX, F32_MAX, 1e-45, -1e30])
    return st.one_of(
        hnp.arrays(
            np.float32,
            st.integers(1, 64),
            elements=st.one_of(st.floats(width=32), edges.map(np.float32)),
        ),
        hnp.arrays(np.float64, st.integers(1, 64), elements=st.one_of(st.floats(), edges)),
        st.integers(1, 64).map(lambda v: np.full(v, -np.inf, dtype=np.float32)),
    )


def _biased(row: npt.NDArray[Any], data: st.DataObject) -> npt.NDArray[Any]:
    """``row`` with a logit_bias (and ignore_eos's ``-inf``) added the way the worker
    adds them: in the row's own dtype, overflow and all."""
    size = row.size
    bias = data.draw(
        st.dictionaries(
            st.integers(0, size - 1),
            st.one_of(st.floats(-100.0, 100.0), st.just(-np.inf)),
            max_size=size,
        )
    )
    if not bias:
        return row
    out = row.copy()
    with np.errstate(all="ignore"):
        out[list(bias)] += np.array(list(bias.values()), dtype=row.dtype)
    return out


def _possible(row: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """The tokens a sampler may pick: the +inf ones if any, else the non-(-inf, nan)
    ones, else all."""
    wide = row.astype(np.float64)
    if np.isposinf(wide).any():
        return np.isposinf(wide)
    finite = np.isfinite(wide)
    return finite if finite.any() else np.ones(row.size, dtype=bool)


@settings(max_examples=300, deadline=None)
@given(
    row=_rows(),
    temperature=st.one_of(st.floats(0.0, 2.0), st.sampled_from(EDGE_TEMPERATURES)),
    top_p=st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([5e-324, 1.0])),
    top_k=st.integers(0, 1000),
    n_top=st.integers(0, 20),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_sampler_is_total(
    row: npt.NDArray[Any],
    temperature: float,
    top_p: float,
    top_k: int,
    n_top: int,
    seed: int,
    data: st.DataObject,
) -> None:
    row = _biased(row, data)
    with np.errstate(invalid="raise", divide="raise"):  # no nan made and hidden
        choice = sample(
            row,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            rng=np.random.default_rng(seed),
            want_logprob=True,
            n_top=n_top,
        )
    assert 0 <= choice.token < row.size
    assert _possible(row)[choice.token]
    assert choice.logprob is not None and math.isfinite(choice.logprob)
    assert LOGPROB_FLOOR <= choice.logprob <= 0.0
    assert len(choice.top) == min(n_top, row.size)
    values = [lp for _, lp in choice.top]
    assert all(math.isfinite(v) and LOGPROB_FLOOR <= v <= 0.0 for v in values)
    assert values == sorted(values, reverse=True)
    if temperature < GREEDY_BELOW:
        wide = np.where(np.isnan(row), -np.inf, row.astype(np.float64))
        assert wide[choice.token] == wide.max()


@settings(max_examples=200, deadline=None)
@given(row=_rows())
def test_log_softmax_never_holds_nan_and_sums_to_one(row: npt.NDArray[Any]) -> None:
    with np.errstate(invalid="raise", divide="raise"):
        out = log_softmax(row)
    assert not np.isnan(out).any()
    assert not np.isposinf(out).any()
    assert float(np.sum(np.exp(out))) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("temperature", [5e-324, 1e-320, 1e-310, 1e-308, 1e-6])
def test_tiny_temperatures_are_greedy_not_a_crash(temperature: float) -> None:
    # The hostile-input run's case: 1e-320 is inside [0, 2]; dividing logits by it
    # gave infinities and "Probabilities contain NaN", which killed the worker.
    logits = np.array([1.0, 3.0, 2.0, -np.inf], dtype=np.float32)
    picks = {
        sample(logits, temperature=temperature, top_p=0.9, top_k=0, rng=_rng(s)).token
        for s in range(20)
    }
    assert picks == {1}


def test_small_temperature_above_the_greedy_threshold_still_samples_among_ties() -> None:
    logits = np.array([5.0, 5.0, -1e30], dtype=np.float32)
    picks = {
        sample(logits, temperature=1e-3, top_p=1.0, top_k=0, rng=_rng(s)).token for s in range(60)
    }
    assert picks == {0, 1}


@pytest.mark.parametrize(
    ("row", "possible"),
    [
        ([np.nan, 1.0, np.nan], {1}),
        ([-np.inf, np.inf, 0.0, np.inf], {1, 3}),
        ([-np.inf, -np.inf, -np.inf], {0, 1, 2}),
        ([np.nan, np.nan], {0, 1}),
        ([F32_MAX, -F32_MAX, F32_MAX], {0, 2}),
    ],
)
def test_degenerate_rows_pick_a_possible_token(row: list[float], possible: set[int]) -> None:
    logits = np.array(row, dtype=np.float32)
    for temperature in (0.0, 1e-320, 0.7, 2.0):
        picks = {
            sample(logits, temperature=temperature, top_p=1.0, top_k=0, rng=_rng(s)).token
            for s in range(40)
        }
        assert picks <= possible
        if temperature >= 0.7:
            assert picks == possible


def test_impossible_tokens_report_the_floor_not_minus_infinity() -> None:
    logits = np.array([0.0, -np.inf, -np.inf], dtype=np.float32)
    choice = sample(logits, temperature=0, top_p=1, top_k=0, rng=_rng(), n_top=3)
    assert choice.logprob == 0.0
    assert choice.top == ((0, 0.0), (1, LOGPROB_FLOOR), (2, LOGPROB_FLOOR))

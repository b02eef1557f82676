from __future__ import annotations

import math

import numpy as np
import pytest

from quantroute.engines.sampling import log_softmax, sample


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

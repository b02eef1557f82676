"""Penalties, min_p and the sampling distribution against a reference computation on
fixed logits: plain Python loops, written from vLLM's and OpenAI's definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantroute.engines.llamacpp.sampler_chain import SamplerChain, chain_seed
from quantroute.engines.sampling import (
    Penalties,
    distribution,
    greedy_in_place,
    penalize,
    sample,
)

LOGITS = [2.0, -1.0, 0.5, 3.0, -np.inf, 0.0, 1.5, -2.5]
PROMPT = [0, 5]
GENERATED = [3, 3, 1, 6, 3]


def _reference_penalize(logits: list[float], p: Penalties) -> list[float]:
    out = []
    for token, x in enumerate(logits):
        if p.repetition != 1.0 and (token in PROMPT or token in GENERATED) and math.isfinite(x):
            x = x / p.repetition if x > 0 else x * p.repetition
        count = GENERATED.count(token)
        x -= p.frequency * count + p.presence * (1 if count else 0)
        out.append(x)
    return out


def _reference_distribution(
    logits: list[float], temperature: float, top_p: float, top_k: int, min_p: float
) -> list[float]:
    best = max(logits)
    weights = [math.exp((x - best) / temperature) if math.isfinite(x) else 0.0 for x in logits]
    order = sorted(range(len(logits)), key=lambda t: -weights[t])
    if top_k:
        order = order[:top_k]
    total = sum(weights[t] for t in order)
    probs = {t: weights[t] / total for t in order}
    if top_p < 1:
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += probs[t]
            if mass >= top_p:
                break
        total = sum(probs[t] for t in kept)
        probs = {t: probs[t] / total for t in kept}
    if min_p:
        top = max(probs.values())
        probs = {t: q for t, q in probs.items() if q >= min_p * top}
        total = sum(probs.values())
        probs = {t: q / total for t, q in probs.items()}
    return [probs.get(t, 0.0) for t in range(len(logits))]


def _state() -> tuple[np.ndarray, np.ndarray]:
    counts = np.zeros(len(LOGITS), dtype=np.int32)
    seen = np.zeros(len(LOGITS), dtype=np.bool_)
    seen[PROMPT] = True
    for t in GENERATED:
        counts[t] += 1
        seen[t] = True
    return counts, seen


@pytest.mark.parametrize(
    "penalties",
    [
        Penalties(),
        Penalties(presence=0.7),
        Penalties(frequency=0.4),
        Penalties(presence=-1.0, frequency=-0.3),
        Penalties(repetition=1.3),
        Penalties(repetition=0.8),
        Penalties(presence=2.0, frequency=2.0, repetition=2.0),
    ],
)
def test_penalties_match_the_reference(penalties: Penalties) -> None:
    counts, seen = _state()
    got = penalize(np.array(LOGITS, dtype=np.float32), penalties, counts, seen)
    want = _reference_penalize(LOGITS, penalties)
    assert np.allclose(got, want, rtol=1e-6) and np.isneginf(got[4])


# (temperature, top_p, top_k, min_p): each truncation alone and together
TRUNCATIONS = [(1.0, 1.0, 0, 0.0), (0.7, 1.0, 0, 0.2), (1.3, 0.8, 0, 0.05), (1.0, 1.0, 3, 0.5),
               (2.0, 0.95, 5, 0.1), (0.5, 1.0, 0, 1.0)]  # fmt: skip


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "min_p"), TRUNCATIONS)
def test_the_distribution_matches_the_reference(
    temperature: float, top_p: float, top_k: int, min_p: float
) -> None:
    counts, seen = _state()
    row = penalize(np.array(LOGITS), Penalties(0.5, 0.2, 1.2), counts, seen)
    got = distribution(row, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    want = _reference_distribution(list(row), temperature, top_p, top_k, min_p)
    assert np.allclose(got, want, atol=1e-12)


def test_sampling_draws_from_that_distribution() -> None:
    rng = np.random.default_rng(0)
    kwargs = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.15}
    want = np.array(_reference_distribution(LOGITS, 1.0, 1.0, 0, 0.15))
    draws = [sample(np.array(LOGITS), rng=rng, **kwargs).token for _ in range(20000)]  # type: ignore[arg-type]
    freq = np.bincount(draws, minlength=len(LOGITS)) / len(draws)
    assert np.all(freq[want == 0] == 0)
    assert np.allclose(freq, want, atol=0.015)


# -- llama.cpp's sampler chain (engines/llamacpp/sampler_chain.py), against the same references --


NO_PENALTIES = Penalties()


def _chain(
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    penalties: Penalties = NO_PENALTIES,
    bias: dict[int, float] | None = None,
    seed: int | None = 0,
    ban: tuple[int, ...] = (),
) -> SamplerChain:
    chain = SamplerChain(
        n_vocab=len(LOGITS),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        bias=bias or {},
        penalties=penalties,
        prompt=PROMPT,
        window=64,
        ban=ban,
    )
    for token in GENERATED:  # what the worker's llama_sampler_sample accepts
        chain.accept(token)
    return chain


def _softmax(row: list[float]) -> np.ndarray:
    x = np.array(row, dtype=np.float64)
    w = np.exp(x - x.max())
    return w / w.sum()


@pytest.mark.parametrize(
    "penalties",
    [Penalties(presence=0.7), Penalties(frequency=0.4), Penalties(presence=-1.0, frequency=-0.3),
     Penalties(repetition=1.3), Penalties(repetition=0.8),
     Penalties(presence=2.0, frequency=2.0, repetition=2.0)],
)  # fmt: skip
def test_the_chains_penalties_have_vllms_meaning(penalties: Penalties) -> None:
    """Repetition over prompt and output, frequency and presence over the output only."""
    chain = _chain(penalties=penalties)
    try:
        got = chain.distribution(LOGITS)
    finally:
        chain.close()
    assert np.allclose(got, _softmax(_reference_penalize(LOGITS, penalties)), atol=1e-6)


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "min_p"), TRUNCATIONS)
def test_the_chains_distribution_matches_the_reference(
    temperature: float, top_p: float, top_k: int, min_p: float
) -> None:
    """Temperature first, then top-k, top-p and min-p, after the penalties."""
    penalties = Penalties(0.5, 0.2, 1.2)
    chain = _chain(temperature, top_p, top_k, min_p, penalties)
    try:
        got = chain.distribution(LOGITS)
    finally:
        chain.close()
    row = _reference_penalize(LOGITS, penalties)
    want = _reference_distribution(row, temperature, top_p, top_k, min_p)
    assert np.allclose(got, want, atol=1e-6)
    assert np.all(got[np.array(want) == 0] == 0)


def test_the_chain_draws_from_that_distribution_and_repeats_by_seed() -> None:
    want = np.array(_reference_distribution(LOGITS, 1.0, 1.0, 0, 0.15))
    runs = []
    for seed in (3, 3, 4):
        chain = _chain(min_p=0.15, seed=seed)
        try:
            runs.append([chain.draw(LOGITS) for _ in range(20000)])
        finally:
            chain.close()
    assert runs[0] == runs[1] and runs[0] != runs[2]
    freq = np.bincount(runs[0], minlength=len(LOGITS)) / len(runs[0])
    assert np.all(freq[want == 0] == 0)
    assert np.allclose(freq, want, atol=0.015)


def test_the_chains_greedy_is_numpys_argmax_bias_and_ban_included() -> None:
    ties = [1.0, 3.0, 3.0, -np.inf]
    for temperature in (0.0, 1e-6, float("nan")):
        chain = _chain(temperature=temperature)
        try:
            assert chain.draw(ties) == int(np.argmax(ties)) == 1  # the first of a tie
        finally:
            chain.close()
    chain = _chain(temperature=0.0, bias={3: 5.0, 0: -1.0}, ban=(3,))  # ban: min_tokens's
    try:
        row = [2.0, -1.0, 0.5, 3.0]  # biased: [1.0, -1.0, 0.5, 8.0], 3 banned
        assert chain.distribution(row)[3] == 0.0 and chain.draw(row) == 0
        chain.lift_ban()  # min_tokens reached: 3.0 + 5.0 wins again
        assert chain.draw(row) == 3
    finally:
        chain.close()
    assert chain.closed


@pytest.mark.parametrize(("seed", "want"), [(None, 0xFFFFFFFF), (0, 0), (-1, 0xFFFFFFFE),
                                            (0xFFFFFFFF, 0), (2**64 - 1, 0), (7, 7)])  # fmt: skip
def test_every_seed_the_schema_admits_is_a_seed_to_llama_cpp(seed: int | None, want: int) -> None:
    assert chain_seed(seed) == want  # 0xFFFFFFFF (LLAMA_DEFAULT_SEED) only for no seed


_LOGIT = st.one_of(
    st.floats(-1e4, 1e4, width=32), st.sampled_from([math.nan, -math.inf, math.inf, 3.0])
)


@given(
    st.lists(_LOGIT, min_size=1, max_size=12),
    st.dictionaries(st.integers(0, 11), st.floats(-100, 100, width=32), max_size=3),
    st.lists(st.integers(0, 11), max_size=2),
)
def test_the_in_place_greedy_token_is_the_samplers(
    logits: list[float], bias: dict[int, float], ban: list[int]
) -> None:
    """The worker's fast greedy path (biases and ban written into llama.cpp's row, then
    its argmax) picks what the numpy sampler picks, nan and infinities included."""
    row = np.array(logits, dtype=np.float32)
    bias = {t: b for t, b in bias.items() if t < row.size}
    ban = [t for t in ban if t < row.size]
    ids = np.array(list(bias), dtype=np.intp) if bias else None
    values = np.array(list(bias.values()), dtype=np.float32) if bias else None
    reference = row.copy()  # biased in float32, as llama.cpp's row is
    if ids is not None:
        reference[ids] += values
    reference[ban] = -math.inf
    want = sample(reference, temperature=0.0, top_p=1.0, top_k=0, rng=np.random.default_rng(0))
    assert greedy_in_place(row, ids, values, ban or None) == want.token

"""Speculative decoding's rule (``engines/llamacpp/speculative.py``) on plain data: the
emitted tokens are distributed as the target's rows whatever the draft's, greedy text is
the target's own, seeds repeat (whatever ``k`` in the coupled mode), and ``k`` goes to the
fastest measured one.

The statistical tests bound each cell's frequency with Hoeffding's inequality and a
union bound over the cells: with ``N`` draws and ``C`` cells a correct rule fails with
probability at most ``DELTA`` (1e-6), and the draws are fixed by their seeds, so a pass
is a pass every run. ``test_the_bound_would_catch_the_usual_mistakes`` checks the bound
is tight enough to fail the rules one gets wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantroute.engines.llamacpp.speculative import (
    AdaptiveK,
    Draws,
    Purpose,
    Verdict,
    verify,
    verify_greedy,
)
from quantroute.engines.sampling import distribution

F64 = npt.NDArray[np.float64]
DELTA = 1e-6  # the most a correct rule fails a statistical test here
N_FIRST = 8_000  # cycles in the first-token test

# A small vocabulary where the draft is wrong in every way it can be: it puts mass on a
# token the target never emits (4), none on one the target does (5), and over- and
# under-weights the rest.
P = np.array([0.30, 0.25, 0.20, 0.15, 0.00, 0.10])
Q = np.array([0.10, 0.40, 0.20, 0.05, 0.25, 0.00])


def _bound(n: int, cells: int) -> float:
    """Hoeffding with a union bound over two-sided cells: P(any |f - p| > b) <= DELTA."""
    return math.sqrt(math.log(2 * cells / DELTA) / (2 * n))


def _frequencies(tokens: list[int], cells: int) -> F64:
    return np.bincount(np.asarray(tokens), minlength=cells) / len(tokens)


def _cycle(p_rows: F64, q_rows: F64, key: int, start: int, k: int) -> list[int]:
    """One speculative cycle over position-indexed rows: draft ``k`` from ``q`` with the
    request's draws, verify against ``k + 1`` target rows (the bonus mode)."""
    draws = Draws(key)
    drafts = [draws.draft(q_rows[start + i], start + i) for i in range(k)]
    verdict = verify(drafts, q_rows[start : start + k], p_rows[start : start + k + 1], draws, start)
    return verdict.emitted(drafts)


def _generate(
    p_rows: F64, q_rows: F64, key: int, n: int, k: int | Callable[[int], int], *, coupled: bool
) -> list[int]:
    """``n`` tokens of a model whose rows depend on the position only, speculatively.

    ``coupled``: every position is a checked draft (``k`` drafts against ``k`` rows), so
    the output must not depend on ``k``; else ``k`` drafts and a bonus row."""
    out: list[int] = []
    draws = Draws(key)
    while len(out) < n:
        kk = k(len(out)) if callable(k) else k
        kk = min(kk, n - len(out) - (0 if coupled else 1))
        start = len(out)
        drafts = [draws.draft(q_rows[start + i], start + i) for i in range(kk)]
        rows = kk if coupled else kk + 1
        verdict = verify(
            drafts, q_rows[start : start + kk], p_rows[start : start + rows], draws, start
        )
        out.extend(verdict.emitted(drafts))
    return out[:n]


# -- sampling: the output is distributed as p ---------------------------------------------


def test_the_first_token_is_distributed_as_the_target_row_whatever_the_draft() -> None:
    n, k = N_FIRST, 3
    rows = 8
    p_rows, q_rows = np.tile(P, (rows, 1)), np.tile(Q, (rows, 1))
    first = [_cycle(p_rows, q_rows, key, 0, k)[0] for key in range(n)]
    freq = _frequencies(first, P.size)
    assert np.abs(freq - P).max() <= _bound(n, P.size)
    assert freq[4] == 0.0  # a token the target gives no mass is never emitted
    assert freq[5] > 0.05  # one the draft never proposes still is (by the residual)


def test_two_tokens_in_a_row_are_distributed_as_the_targets_rows() -> None:
    # Position-dependent rows: the second token comes from a kept draft, a correction or
    # the next cycle, and must still follow p_2, independently of the first.
    n = 6_000
    p2 = np.array([0.05, 0.05, 0.40, 0.10, 0.20, 0.20])
    q2 = np.array([0.30, 0.10, 0.10, 0.30, 0.10, 0.10])
    p_rows = np.stack([P, p2, P, p2])
    q_rows = np.stack([Q, q2, Q, q2])
    pairs = [_generate(p_rows, q_rows, key, 2, 2, coupled=False) for key in range(n)]
    cells = P.size * P.size
    freq = _frequencies([a * P.size + b for a, b in pairs], cells)
    assert np.abs(freq - np.outer(P, p2).reshape(-1)).max() <= _bound(n, cells)


def test_the_bound_would_catch_the_usual_mistakes() -> None:
    # The exact output distribution of three wrong rules, each farther from P than the
    # bound the tests above allow: the tests can fail.
    kept = np.minimum(P, Q)  # kept drafts: q(x) min(1, p/q)
    rejected = 1.0 - kept.sum()
    residual = np.maximum(P - Q, 0.0) / np.maximum(P - Q, 0.0).sum()
    assert np.allclose(kept + rejected * residual, P)  # the rule itself: exactly P
    mistakes = {
        "resample from p": kept + rejected * P,
        "keep every draft": Q,
        "resample from q": kept + rejected * Q,
    }
    for name, wrong in mistakes.items():
        assert np.abs(wrong - P).max() > 2 * _bound(N_FIRST, P.size), name


def test_with_transformed_rows_the_output_follows_the_transformed_target() -> None:
    # p and q after temperature / top-k / top-p (the rows the rule must be given): the
    # target's cut tokens never appear, and the rest follow its renormalised row.
    rng = np.random.default_rng(3)
    logits_p, logits_q = rng.normal(size=8), rng.normal(size=8)
    p = distribution(logits_p, temperature=0.7, top_p=0.9, top_k=5)
    q = distribution(logits_q, temperature=0.7, top_p=0.9, top_k=5)
    n = 6_000
    first = [_cycle(np.stack([p, p]), np.stack([q, q]), key, 0, 1)[0] for key in range(n)]
    freq = _frequencies(first, p.size)
    assert np.all(freq[p == 0] == 0)
    assert np.abs(freq - p).max() <= _bound(n, p.size)


_rows = hnp.arrays(
    np.float64, st.integers(2, 12), elements=st.floats(0.0, 1.0, allow_subnormal=False)
).filter(lambda a: a.sum() > 1e-3)


@settings(max_examples=30, deadline=None)
@given(row=_rows, k=st.integers(0, 5), key=st.integers(0, 2**64 - 1))
def test_when_the_draft_is_the_target_every_draft_is_kept(row: F64, k: int, key: int) -> None:
    p = row / row.sum()
    rows = np.tile(p, (k + 1, 1))
    draws = Draws(key)
    drafts = [draws.draft(p, i) for i in range(k)]
    verdict = verify(drafts, rows[:k], rows, draws, 0)
    assert verdict.accepted == k
    assert verdict.token is not None and p[verdict.token] > 0


@settings(max_examples=30, deadline=None)
@given(p_row=_rows, q_row=_rows, k=st.integers(1, 4), key=st.integers(0, 2**64 - 1), data=st.data())
def test_a_verdict_is_well_formed_and_repeats_for_its_seed(
    p_row: F64, q_row: F64, k: int, key: int, data: st.DataObject
) -> None:
    size = min(p_row.size, q_row.size)
    assume(p_row[:size].sum() > 1e-3 and q_row[:size].sum() > 1e-3)  # cut rows keep mass
    p, q = p_row[:size] / p_row[:size].sum(), q_row[:size] / q_row[:size].sum()
    start = data.draw(st.integers(0, 1000))
    draws = Draws(key)
    drafts = [draws.draft(q, start + i) for i in range(k)]
    assert all(q[d] > 0 for d in drafts)
    args = (drafts, np.tile(q, (k, 1)), np.tile(p, (k + 1, 1)))
    verdict = verify(*args, draws, start)
    assert verify(*args, Draws(key), start) == verdict  # the seed repeats it
    assert 0 <= verdict.accepted <= k
    assert verdict.token is not None and p[verdict.token] > 0  # never a token p excludes
    for d in drafts[: verdict.accepted]:
        assert p[d] > 0


def test_seeds_repeat_and_differ() -> None:
    p_rows, q_rows = np.tile(P, (40, 1)), np.tile(Q, (40, 1))
    runs = [_generate(p_rows, q_rows, key, 30, 3, coupled=False) for key in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_coupled_drafting_gives_the_same_text_whatever_k() -> None:
    # Every position decided the same way (a checked draft): the output of a seed is a
    # function of the seed and the rows only, so any k schedule gives it.
    rng = np.random.default_rng(5)
    p_rows = rng.dirichlet(np.ones(6), size=41)
    q_rows = 0.5 * p_rows + 0.5 * rng.dirichlet(np.ones(6), size=41)
    for key in range(20):
        runs = {
            tuple(_generate(p_rows, q_rows, key, 40, k, coupled=True))
            for k in (1, 2, 3, 5, lambda n: 1 + n % 4)
        }
        assert len(runs) == 1


def test_uniforms_are_per_position_and_purpose() -> None:
    draws = Draws(2**70 + 3)  # keys past 64 bits count whole
    assert draws.uniform(5, Purpose.ACCEPT) != Draws(3).uniform(5, Purpose.ACCEPT)
    values = {draws.uniform(n, purpose) for n in range(50) for purpose in Purpose}
    assert len(values) == 50 * len(Purpose)
    assert all(0.0 <= u < 1.0 for u in values)


def test_verify_refuses_rows_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="target rows"):
        verify([1, 2], np.tile(Q, (2, 1)), np.tile(P, (4, 1)), Draws(0), 0)
    with pytest.raises(ValueError, match="no mass"):
        verify([5], Q[None], P[None], Draws(0), 0)  # Q gives token 5 nothing


def test_without_a_bonus_row_a_fully_kept_run_adds_nothing() -> None:
    verdict = verify([0, 1], np.tile(P, (2, 1)), np.tile(P, (2, 1)), Draws(1), 0)
    assert verdict == Verdict(2, None)
    assert verdict.emitted([0, 1]) == [0, 1]


# -- greedy: the target's text, token for token ---------------------------------------------


def _row(model: int, prefix: tuple[int, ...], vocab: int) -> F64:
    """A deterministic row of logits for a prefix: a toy language model."""
    seed = hash((model, prefix)) & 0xFFFFFFFF
    return np.random.default_rng(seed).normal(size=vocab)


def _greedy(prefix: tuple[int, ...], n: int, vocab: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(_row(0, prefix + tuple(out), vocab))))
    return out


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple),
    n=st.integers(1, 24),
    k=st.integers(1, 6),
    noise=st.floats(0.0, 3.0),
)
def test_greedy_speculation_is_the_targets_greedy_text(
    prompt: tuple[int, ...], n: int, k: int, noise: float
) -> None:
    vocab = 8
    out: list[int] = []
    cycles = 0
    while len(out) < n:
        ctx = prompt + tuple(out)
        drafts: list[int] = []
        for _ in range(min(k, n - len(out))):  # the draft: the target's row plus noise
            row = _row(0, ctx + tuple(drafts), vocab) + noise * _row(1, ctx + tuple(drafts), vocab)
            drafts.append(int(np.argmax(row)))
        targets = [
            int(np.argmax(_row(0, ctx + tuple(drafts[:i]), vocab))) for i in range(len(drafts) + 1)
        ]
        out.extend(verify_greedy(drafts, targets).emitted(drafts))
        cycles += 1
    assert out[:n] == _greedy(prompt, n, vocab)
    if noise == 0.0:  # a perfect draft: every cycle emits all its drafts and a bonus
        assert cycles == math.ceil(n / (k + 1))


def test_greedy_verdicts() -> None:
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == Verdict(3, 8)
    assert verify_greedy([5, 6, 7], [4, 6, 7, 8]) == Verdict(0, 4)
    assert verify_greedy([5, 6, 7], [5, 6, 9]) == Verdict(2, 9)
    assert verify_greedy([5, 6], [5, 6]) == Verdict(2, None)
    assert verify_greedy([], [3]) == Verdict(0, 3)


# -- how many to draft ----------------------------------------------------------------------


def _drive(control: AdaptiveK, alpha: Callable[[int], float], steps: int, seed: int) -> list[int]:
    """``steps`` steps of a simulated CPU worker: a step with ``k`` drafts keeps each with
    probability ``alpha(step)`` until the first rejection and costs ``1 + 0.12 k`` plain
    steps (drafts and a wider verify), times a load factor in [1, 1.3); the ``k`` chosen."""
    rng = np.random.default_rng(seed)
    ks = []
    for step in range(steps):
        k = control.choose()
        kept = 0
        while kept < k and rng.random() < alpha(step):
            kept += 1
        control.observe(k, kept + 1, (1.0 + 0.12 * k) * (1.0 + 0.3 * rng.random()))
        ks.append(k)
    return ks


def test_adaptive_k_climbs_to_the_fastest_k() -> None:
    # alpha 0.95: tokens per cost is 1.0, 1.75, 2.4, 3.0, 3.9 (k = 0, 1, 2, 4, 8): k = 8
    control = AdaptiveK(k_max=8)
    assert control.candidates == (0, 1, 2, 4, 8)
    ks = _drive(control, lambda _: 0.95, 400, seed=0)
    assert ks[:10] == [0, 0, 1, 1, 2, 2, 4, 4, 8, 8]  # each measured twice, in order
    assert control.best == 8
    late = ks[200:]
    assert late.count(8) >= 0.85 * len(late)  # exploited: the rest is exploration
    assert set(late) == {0, 1, 2, 4, 8}  # every other k is measured again now and then


def test_adaptive_k_falls_back_to_plain_when_drafts_are_rejected_and_probes_again() -> None:
    control = AdaptiveK(k_max=8, explore_every=8)
    ks = _drive(control, lambda step: 0.95 if step < 200 or step >= 600 else 0.0, 900, 1)
    assert ks[150:200].count(8) >= 40
    rejected = ks[300:600]  # every draft rejected: a drafted step costs more for 1 token
    assert rejected.count(0) >= 0.95 * len(rejected)  # probes are rarer while plain wins:
    assert 0 not in ks[319:600:32]  # every 32nd step (the 32nd, 64th, ...) probes a k >= 1
    assert ks[800:].count(8) >= 75  # accepted again: it climbed back to k = 8 (7 in 8 at most)


def test_adaptive_k_picks_a_middle_k_when_that_is_fastest() -> None:
    # alpha 0.6: tokens per cost 1.0, 1.43, 1.57, 1.53, 1.26: k = 2 (or 4, within noise)
    control = AdaptiveK(k_max=8)
    ks = _drive(control, lambda _: 0.6, 1500, seed=2)
    late = ks[500:]  # exploration alone gives 0 and 8 a sixteenth each
    assert late.count(2) + late.count(4) >= 0.6 * len(late)
    assert late.count(0) + late.count(8) <= 0.2 * len(late)


def test_adaptive_k_is_deterministic_and_respects_k_max_and_always() -> None:
    a, b = AdaptiveK(k_max=8), AdaptiveK(k_max=8)
    assert _drive(a, lambda _: 0.7, 200, seed=3) == _drive(b, lambda _: 0.7, 200, seed=3)
    assert AdaptiveK(k_max=3).candidates == (0, 1, 2, 3)
    always = AdaptiveK(k_max=6, floor=1)
    assert always.candidates == (1, 2, 4, 6)
    assert 0 not in _drive(always, lambda _: 0.0, 200, seed=4)  # even when drafts never pay
    assert always.best == 1


def test_adaptive_k_measures_the_speedup_it_gives() -> None:
    """The best ``k``'s rate over plain's: what routing credits the reference with."""
    control = AdaptiveK(k_max=8)
    assert control.speedup == 0.0  # nothing measured yet
    _drive(control, lambda _: 0.95, 400, seed=0)
    # alpha 0.95 and a cost of 1 + 0.12 k a step: k = 8 gives about 3.9 times plain's rate
    assert 3.0 < control.speedup < 4.8
    assert control.speedup == pytest.approx(control.rate(control.best) / control.rate(0))
    rejecting = AdaptiveK(k_max=8)
    _drive(rejecting, lambda _: 0.0, 400, seed=1)
    assert rejecting.speedup == 1.0  # plain is fastest: no gain, and no loss (auto)
    always = AdaptiveK(k_max=8, floor=1)
    _drive(always, lambda _: 0.95, 100, seed=2)
    assert always.speedup == 0.0  # plain never measured: unknown


def test_adaptive_k_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        AdaptiveK(decay=0.0)
    with pytest.raises(ValueError):
        AdaptiveK(floor=2)
    with pytest.raises(ValueError):
        AdaptiveK().observe(2, 3, 0.0)


@pytest.mark.parametrize("sequences", [1, 4])
def test_a_steps_rate_is_learnt_per_speculating_sequence(sequences: int) -> None:
    """Before: a step's tokens over its time, whatever the number of sequences in it, so a
    k measured while five sequences ran read five times faster than one measured alone
    (and the speed-up routing was told with it). Now per sequence: a request's rate."""
    from types import SimpleNamespace

    from quantroute.engines.llamacpp.worker_speculative import Drafter, SpecState

    drafter = Drafter(SimpleNamespace(parallel=4), "q4_k_m.gguf", k_max=4)  # type: ignore[arg-type]
    seen: list[tuple[int, float, float]] = []
    drafter.control.observe = lambda k, tokens, seconds: seen.append((k, tokens, seconds))  # type: ignore[method-assign]
    for _ in range(sequences):  # the first k tried is 0: each emits its one token
        seq = SimpleNamespace(spec=SpecState(4), max_tokens=64, generated=0, n_past=8)
        assert drafter.k_for(seq, 512) == 0  # type: ignore[arg-type]
    drafter.timed_step(0.01)
    assert seen == [(0, 1.0, 0.01)]


class _FakeDraft:
    """A draft model that decodes anything and always proposes token 1."""

    n_batch, parallel, eog_set, eog_tokens = 512, 1, frozenset({0}), [0]

    def __init__(self) -> None:
        self.fed: list[int] = []  # tokens per decode

    def put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        pass

    def decode(self, n: int) -> int:
        self.fed.append(n)
        return 0

    def row(self, i: int) -> npt.NDArray[np.float32]:
        return np.array([0.0, 1.0, 0.0], dtype=np.float32)

    def keep_prefix(self, slot: int, keep: int) -> bool:
        return True

    def clear(self, slot: int) -> None:
        pass


@pytest.mark.parametrize(("behind", "measured"), [(33, True), (65, False)])
def test_a_probe_after_plain_steps_still_measures_its_k(behind: int, measured: bool) -> None:
    """While plain decoding is fastest, one step in 32 probes a k, and the draft first
    catches up the tokens decoded plainly since: that step still measures the k (else
    drafting could never win again); catching up a prompt does not."""
    from types import SimpleNamespace

    from quantroute.engines.base import SamplingParams
    from quantroute.engines.llamacpp.worker_speculative import Drafter, SpecState

    draft = _FakeDraft()
    drafter = Drafter(draft, "q4_k_m.gguf", k_max=4, mode="fixed")  # type: ignore[arg-type]
    seen: list[int] = []
    drafter.control.observe = lambda k, tokens, seconds: seen.append(k)  # type: ignore[method-assign]
    seq = SimpleNamespace(
        spec=SpecState(4),
        max_tokens=512,
        generated=0,
        n_past=8,
        slot=0,
        prompt=[5] * 8,
        out=[],
        bias_ids=None,
        bias_values=None,
        sampling=SamplingParams(temperature=0.0),
    )
    seq.out = [2] * behind
    drafter._arm = drafter.k_for(seq, 4096)  # type: ignore[arg-type]
    drafter.propose([(seq, 4)])  # type: ignore[list-item]
    assert seq.spec.drafts == [1, 1, 1, 1] and draft.fed[0] == 8 + behind
    drafter._emitted = 5  # what the verdict would count
    drafter.timed_step(0.01)
    assert seen == ([4] if measured else [])

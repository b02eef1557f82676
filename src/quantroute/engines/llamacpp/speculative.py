"""Speculative decoding's decisions (worker process): which drafted tokens the reference
keeps, the token it adds, and how many to draft next. Pure numpy; nothing here decodes.

A cheap branch (the *draft*, a Q4_K_M) proposes ``d_1..d_k``; the reference (the
*target*, an F16) decodes them in one batch and gives rows ``p_1..p_{k+1}``, ``p_i`` the
distribution of the token at the place of ``d_i`` (``p_{k+1}``: the one after ``d_k``).

- **Greedy** (:func:`verify_greedy`): keep ``d_i`` while it is the target's own greedy
  token, then add the target's greedy token where they first differ (or after ``d_k``).
  The text is the target's, token for token, as far as its rows are the rows plain
  decoding would compute: llama.cpp does not promise that a row is the same bits in a
  batch of ``k + 1`` as alone (the demo's F16 on a CPU: up to 8e-4 apart in a logit), so
  a near tie can go the other way, as it can in plain continuous batching.
- **Sampling** (:func:`verify`): the standard rule (Leviathan et al. 2023; Chen et al.
  2023): keep ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
  rejection draw from ``(p_i - q_i)+`` normalised and stop; if all ``k`` are kept, draw a
  bonus token from ``p_{k+1}``. Each emitted token is distributed as ``p`` says, whatever
  ``q`` is. ``p`` and ``q`` are the rows *after* the request's transforms (temperature,
  top-k, top-p, min-p, penalties: :func:`quantroute.engines.sampling.distribution`), so
  the output is distributed as the transformed reference, as plain sampling is.

Randomness is counter-based (:class:`Draws`): the uniforms a token at output position
``n`` uses come from ``(key, n, purpose)`` alone, never from how many draws came before.
A seeded request then repeats whatever ``k`` the controller picked, provided every
position is decided the same way: the draft draws its token from ``q_n`` with
:meth:`Draws.draft` and the target checks it, including the last one — draft ``k + 1``
tokens and verify them against the same ``k + 1`` target rows (``verify`` with as many
``p`` rows as drafts), so no position is a "bonus" in one run and a checked draft in
another. With ``k`` drafts and ``k + 1`` rows (the bonus), the output is still
distributed as ``p``, and still repeats for one ``(seed, k schedule)``, but changes
with the schedule.

:class:`AdaptiveK` picks ``k`` (0: decode plainly) by the tokens per second each ``k``
has been measured to give, trying the others now and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

__all__ = [
    "CANDIDATES",
    "AdaptiveK",
    "Draws",
    "Purpose",
    "Verdict",
    "verify",
    "verify_greedy",
]

F64 = npt.NDArray[np.float64]
_MASK64 = (1 << 64) - 1
_UNIT = 2.0**-53
#: Below this much mass the residual ``(p - q)+`` is rounding, not a distribution: the
#: rejection that led to it had probability about this small, so draw from ``p``.
_RESIDUAL_FLOOR = 1e-12


class Purpose(IntEnum):
    """What a uniform at one output position is for; each its own stream."""

    DRAFT = 0  # the draft's token, drawn from q
    ACCEPT = 1  # the accept test against min(1, p/q)
    RESIDUAL = 2  # the token drawn from (p - q)+ after a rejection
    BONUS = 3  # the token drawn from p after every draft was kept


@dataclass(frozen=True, slots=True)
class Draws:
    """A request's counter-based uniforms: a hash of (``key``, position, purpose), ``key``
    the request's seed (or entropy drawn once at admission), so the uniform for a token
    does not depend on what was drawn before it.

    The hash is SplitMix64's finaliser (Steele et al. 2014, Java's ``SplittableRandom``)
    applied to the key and then to the key's hash xor the counter: 53 well-mixed bits per
    uniform in a few microseconds of Python, where a fresh ``numpy.random.Philox`` per
    draw took about 45.

    >>> Draws(7).uniform(3, Purpose.ACCEPT) == Draws(7).uniform(3, Purpose.ACCEPT)
    True
    """

    key: int

    def uniform(self, position: int, purpose: Purpose) -> float:
        """The uniform in ``[0, 1)`` for output ``position``'s ``purpose``."""
        key = self.key % (1 << 128)
        base = _mix64(_mix64(key & _MASK64) ^ (key >> 64))
        counter = ((position & (_MASK64 >> 2)) << 2) | int(purpose)  # 4 purposes
        return (_mix64(base ^ counter) >> 11) * _UNIT

    def pick(self, probs: F64, position: int, purpose: Purpose) -> int:
        """A token from ``probs`` (``[V]``, non-negative, any positive sum) by inverse CDF."""
        return _inverse_cdf(probs, self.uniform(position, purpose))

    def draft(self, q: F64, position: int) -> int:
        """The draft's token for output ``position``, drawn from its row ``q``."""
        return self.pick(q, position, Purpose.DRAFT)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verification's outcome: the first ``accepted`` drafts are kept, then ``token``
    follows them (a correction, or a bonus when all were kept); ``None`` when every draft
    was kept and there was no row to draw a bonus from."""

    accepted: int
    token: int | None

    def emitted(self, drafts: Sequence[int]) -> list[int]:
        """The tokens the cycle adds, in order."""
        kept = list(drafts[: self.accepted])
        return kept if self.token is None else [*kept, self.token]


def verify_greedy(drafts: Sequence[int], targets: Sequence[int]) -> Verdict:
    """Greedy verification: ``targets[i]`` is the target's greedy token at the place of
    ``drafts[i]`` (its biases and bans applied, as plain decoding picks it); ``targets``
    holds ``len(drafts)`` or ``len(drafts) + 1`` entries (the last: after every draft).

    >>> verify_greedy([5, 6, 7], [5, 6, 9, 2])
    Verdict(accepted=2, token=9)
    """
    _check_rows(len(drafts), len(targets))
    for i, (d, t) in enumerate(zip(drafts, targets, strict=False)):
        if d != t:
            return Verdict(i, int(t))
    k = len(drafts)
    return Verdict(k, int(targets[k]) if len(targets) > k else None)


def verify(
    drafts: Sequence[int],
    q: npt.ArrayLike,  # [k, V] the draft's transformed rows d_i was drawn from
    p: npt.ArrayLike,  # [k or k+1, V] the target's transformed rows
    draws: Draws,
    start: int,  # the output position of drafts[0]
) -> Verdict:
    """The standard acceptance rule (module docstring) over probability rows.

    Keep ``d_i`` when ``u * q_i(d_i) < p_i(d_i)`` (``u`` uniform, so with probability
    ``min(1, p/q)``); at the first rejection the token is drawn from ``(p_i - q_i)+``
    normalised; with a ``(k+1)``-th row of ``p`` and every draft kept, from it."""
    k = len(drafts)
    q_rows = np.asarray(q, dtype=np.float64).reshape(k, -1) if k else np.zeros((0, 0))
    p_rows = np.asarray(p, dtype=np.float64)
    p_rows = p_rows.reshape(p_rows.shape[0] if p_rows.ndim > 1 else 1, -1)
    _check_rows(k, p_rows.shape[0] if p_rows.size else 0)
    for i, d in enumerate(drafts):
        qi, pi = q_rows[i], p_rows[i]
        if not qi[d] > 0.0:
            raise ValueError(f"draft {i} (token {d}) has no mass in its own row q")
        u = draws.uniform(start + i, Purpose.ACCEPT)
        if u * qi[d] < pi[d]:
            continue
        residual = np.maximum(pi - qi, 0.0)  # [V]
        if residual.sum() < _RESIDUAL_FLOOR:
            residual = pi
        return Verdict(i, draws.pick(residual, start + i, Purpose.RESIDUAL))
    if p_rows.shape[0] > k:
        return Verdict(k, draws.pick(p_rows[k], start + k, Purpose.BONUS))
    return Verdict(k, None)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit words that scrambles every bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _check_rows(k: int, rows: int) -> None:
    if rows not in (k, k + 1):
        raise ValueError(f"{k} drafts need {k} or {k + 1} target rows, not {rows}")


def _inverse_cdf(probs: F64, u: float) -> int:
    cdf = np.cumsum(probs)  # [V], in float64 and one fixed order: the same token each time
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("a distribution with no mass")
    token = int(np.searchsorted(cdf, u * total, side="right"))
    token = min(token, cdf.size - 1)
    while probs[token] <= 0.0:  # u * total rounded onto a zero-mass tail: step back
        token -= 1
    return token


# -- how many to draft ---------------------------------------------------------------

#: The ``k`` an :class:`AdaptiveK` tries (0: no drafts), those at most its ``k_max``.
CANDIDATES = (0, 1, 2, 4, 8)


@dataclass(slots=True)
class _Arm:
    """One candidate ``k``'s measurements, decayed to its last observation."""

    k: int
    tokens: float = 0.0  # emitted per speculating sequence in its steps
    seconds: float = 0.0  # those steps' time
    seen: int = 0  # observations, undecayed
    last: int = -1  # the step count at its last observation

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0.0 else 0.0


PLAIN_EXPLORE = 4  # probes are this many times rarer while plain decoding is the fastest


class AdaptiveK:
    """A worker's choice of ``k`` for a step, by measurement: per candidate ``k``
    (:data:`CANDIDATES` up to ``k_max``, and ``k_max`` itself; 0 included unless
    ``floor`` is 1), the tokens emitted per second of step time, summed over the steps
    that used it, each weighed ``decay ** age`` (``age`` in steps of any ``k``): a ``k``
    measured again after a while is mostly its new measurement, so a rate measured
    under other text or other load does not linger.

    Why measured, not modelled: a model ``1 + k (c + v)`` of a cycle's cost, fitted from
    the steps taken, does not fit a CPU (verifying ``k + 1`` positions costs neither one
    step nor ``k + 1``, and the draft's cost per depth falls with its batch) and, fitted
    at the ``k`` it chose, never learns that another ``k`` is faster. A measured rate per
    ``k`` sees every cost there is (drafting, catch-up, verifying, picking, sending).

    :meth:`choose` first tries each candidate ``warmup`` times (in ascending order), then
    exploits the best rate, except every ``explore_every``-th step, which goes to the
    candidate measured longest ago: a ``k`` that lost under other text or other load is
    measured again, at about ``1 / explore_every`` of the steps. While plain decoding is
    the fastest (drafts do not pay), only every ``PLAIN_EXPLORE * explore_every``-th step
    probes: each probe then costs a drafted step for little gain, so auto stays near
    plain's speed. Deterministic in the sequence of calls, so tests repeat."""

    def __init__(
        self,
        *,
        k_max: int = 8,
        floor: int = 0,
        candidates: Sequence[int] = CANDIDATES,
        decay: float = 0.95,
        warmup: int = 2,
        explore_every: int = 8,
    ):
        if not 0.0 < decay <= 1.0 or k_max < 1 or floor not in (0, 1) or explore_every < 2:
            raise ValueError("decay in (0, 1], k_max >= 1, floor 0 or 1, explore_every >= 2")
        ks = sorted({min(k, k_max) for k in [*candidates, k_max] if k >= floor})
        self.k_max = k_max
        self._arms = {k: _Arm(k) for k in ks}
        self._decay = decay
        self._warmup = warmup
        self._explore_every = explore_every
        self._steps = 0  # choices made

    @property
    def candidates(self) -> tuple[int, ...]:
        return tuple(self._arms)

    def rate(self, k: int) -> float:
        """``k``'s measured tokens per second (0 until measured)."""
        return self._arms[k].rate

    @property
    def speedup(self) -> float:
        """The measured-fastest ``k``'s rate over plain decoding's (``k`` 0): what drafting
        gives now, 1.0 when plain is fastest; 0.0 while either is unmeasured, or where 0 is
        no candidate (``floor`` 1)."""
        plain = self._arms.get(0)
        if plain is None or not plain.seen or not plain.rate:
            return 0.0
        fastest = self._arms[self.best]
        return fastest.rate / plain.rate if fastest.seen else 0.0

    @property
    def best(self) -> int:
        """The measured-fastest ``k`` (the smallest on a tie)."""
        return max(self._arms.values(), key=lambda a: (a.rate, -a.k)).k

    def choose(self) -> int:
        """The ``k`` of the next step."""
        self._steps += 1
        arms = list(self._arms.values())
        fresh = [a for a in arms if a.seen < self._warmup]
        if fresh:
            return fresh[0].k
        best = self.best
        every = self._explore_every * (PLAIN_EXPLORE if best == 0 else 1)
        if self._steps % every == 0 and len(arms) > 1:
            return min((a for a in arms if a.k != best), key=lambda a: a.last).k
        return best

    def observe(self, k: int, tokens: float, seconds: float) -> None:
        """A step with ``k`` (a :meth:`choose` answer) emitted ``tokens`` in ``seconds``
        (the worker gives them per speculating sequence)."""
        if tokens < 0 or not seconds > 0.0:
            raise ValueError("tokens >= 0 and seconds > 0")
        arm = self._arms[k]
        fade = self._decay ** (self._steps - arm.last) if arm.seen else 0.0
        arm.tokens = fade * arm.tokens + tokens
        arm.seconds = fade * arm.seconds + seconds
        arm.seen += 1
        arm.last = self._steps

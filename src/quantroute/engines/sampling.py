"""Next-token choice from one row of logits: penalties, greedy, temperature, top-k,
top-p, min-p.

Pure numpy, called by the llama.cpp worker once per sequence per step.
Log-probabilities reported to clients are the model's own distribution
(temperature 1, no truncation), as vLLM reports them.

The sampler is total: for any parameters the request schema admits
(``temperature`` in [0, 2], subnormals included; ``top_p`` in (0, 1];
``top_k`` >= 0) and any non-empty row of logits (``-inf`` entries, a row that
is all ``-inf``, ``+inf``, ``nan``, values near the float32 limit), it returns
a token id in ``[0, V)`` and finite log-probabilities, never raising. What a
degenerate row means:

- ``nan`` counts as ``-inf`` (the token is impossible);
- if any logit is ``+inf``, those tokens share all the mass;
- if every logit is ``-inf``, every token is equally likely.

Arithmetic is in float64 with the maximum subtracted *before* dividing by the
temperature, so the best token's scaled logit is exactly 0 and the
normalising sum is at least 1, whatever the temperature: a tiny temperature
turns every other logit into ``-inf`` (probability 0) rather than overflowing.
Temperatures below :data:`GREEDY_BELOW` are greedy outright.

Penalties (:func:`penalize`, before sampling) have vLLM's meanings:
``repetition_penalty`` ``r`` divides a positive logit by ``r`` and multiplies a
negative one by it, for every token in the prompt or the output so far; then
OpenAI's ``frequency_penalty`` and ``presence_penalty`` subtract ``f * count``
and ``p * (count > 0)``, counting the output's tokens only. After temperature,
top-k and top-p, ``min_p`` keeps the tokens whose probability is at least
``min_p`` times the most likely one's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "GREEDY_BELOW",
    "LOGPROB_FLOOR",
    "Choice",
    "Penalties",
    "choice_of",
    "distribution",
    "greedy_in_place",
    "log_softmax",
    "penalize",
    "sample",
]

FloatArray = npt.NDArray[np.floating[Any]]
F64 = npt.NDArray[np.float64]

#: Temperatures below this are greedy: the distribution is a point mass at the
#: argmax to within float64 rounding anyway.
GREEDY_BELOW = 1e-5
#: The log-probability reported for an impossible token (OpenAI reports
#: ``-9999.0``); JSON has no ``-Infinity``.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class Choice:
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Penalties:
    presence: float = 0.0  # [-2, 2], over the output's tokens
    frequency: float = 0.0  # [-2, 2], times each output token's count
    repetition: float = 1.0  # > 0; 1 is off; over the prompt's and the output's tokens

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)


def penalize(
    logits: FloatArray,  # [V]
    penalties: Penalties,
    counts: npt.NDArray[np.integer[Any]],  # [V] how often each token was generated
    seen: npt.NDArray[np.bool_],  # [V] in the prompt or generated
) -> F64:
    """The row with the penalties applied (module docstring); ``-inf`` stays ``-inf``."""
    row = np.array(logits, dtype=np.float64).reshape(-1)
    if penalties.repetition != 1.0:
        r = penalties.repetition
        hit = seen & np.isfinite(row)
        row[hit] = np.where(row[hit] > 0, row[hit] / r, row[hit] * r)
    if penalties.frequency or penalties.presence:
        with np.errstate(invalid="ignore"):  # -inf minus a finite value: still -inf
            row -= penalties.frequency * counts + penalties.presence * (counts > 0)
    return row


def _clean(logits: FloatArray) -> F64:
    """The row in float64 with the degenerate cases of the module docstring resolved:
    no ``nan``, no ``+inf``, and at least one finite entry. # [V]"""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if row.size == 0:
        raise ValueError("a row of logits must hold at least one token")
    row = np.where(np.isnan(row), -np.inf, row)
    top = np.isposinf(row)
    if top.any():
        return np.where(top, 0.0, -np.inf)
    if np.isneginf(row).all():
        return np.zeros_like(row)
    return row


def log_softmax(logits: FloatArray) -> F64:
    """Stable log-softmax over a [V] row; ``-inf`` logits stay ``-inf``.

    Degenerate rows are read as the module docstring says (``nan`` is ``-inf``; an
    all ``-inf`` row is uniform), so the result never holds ``nan``.

    >>> log_softmax(np.array([-np.inf, -np.inf])).tolist() == [np.log(0.5)] * 2
    True
    """
    row = _clean(logits)
    with np.errstate(over="ignore", under="ignore"):  # to -inf and to 0: both meant
        shifted = row - np.max(row)  # the max is finite and becomes exactly 0
        result: F64 = shifted - np.log(np.sum(np.exp(shifted)))
    return result


def sample(
    logits: FloatArray,  # [V]
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    rng: np.random.Generator,
    min_p: float = 0.0,
    want_logprob: bool = False,
    n_top: int = 0,
) -> Choice:
    """One token from ``logits``; with ``want_logprob`` / ``n_top``, its log-probability
    and the ``n_top`` most likely tokens' (model distribution, floored at
    :data:`LOGPROB_FLOOR`). ``top_k`` 0 is off; ``top_p`` 1 is off; ``min_p`` 0 is off."""
    row = _clean(logits)
    if not temperature >= GREEDY_BELOW:  # nan too: greedy rather than a crash
        token = int(np.argmax(row))
    else:
        with np.errstate(over="ignore", under="ignore"):  # to -inf and to 0: both meant
            candidates, probs = _truncated(row, temperature, top_p, top_k, min_p)
            token = int(candidates[rng.choice(probs.size, p=probs)])
    return choice_of(row, token, want_logprob=want_logprob, n_top=n_top)


def greedy_in_place(
    row: npt.NDArray[np.float32],  # [V], llama.cpp's own buffer: written to
    bias_ids: npt.NDArray[np.intp] | None,
    bias_values: npt.NDArray[np.float32] | None,
    banned: Sequence[int] | None,
) -> int:
    """:func:`sample`'s greedy token, found where the row lies: the biases added and the
    ``banned`` tokens set to ``-inf`` in ``row`` itself, then the first highest logit.
    A ``nan`` counts as ``-inf``, and a row with nothing possible is uniform, so 0
    (module docstring)."""
    if bias_ids is not None and bias_values is not None:
        row[bias_ids] += bias_values
    if banned:
        row[banned] = -np.inf
    token = int(row.argmax())
    best = row[token]
    if best != best or best == -np.inf:  # argmax stops at the first nan; or nothing is possible
        cleaned = np.where(np.isnan(row), -np.inf, row)
        token = int(cleaned.argmax()) if cleaned.max() > -np.inf else 0  # all -inf: uniform
    return token


def choice_of(logits: FloatArray, token: int, *, want_logprob: bool, n_top: int) -> Choice:
    """``token`` as a :class:`Choice` of ``logits``, with its log-probabilities."""
    if not (want_logprob or n_top > 0):
        return Choice(token, None, ())
    logprobs = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        k = min(n_top, logprobs.size)
        idx = np.argpartition(-logprobs, k - 1)[:k]
        idx = idx[np.argsort(-logprobs[idx], kind="stable")]
        top = tuple((int(i), _reported(logprobs[i])) for i in idx)
    return Choice(token, _reported(logprobs[token]), top)


def _reported(logprob: np.floating[Any]) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def distribution(
    logits: FloatArray, *, temperature: float, top_p: float, top_k: int, min_p: float = 0.0
) -> F64:
    """The probabilities :func:`sample` draws from (temperature above greedy): ``[V]``,
    zero outside the kept tokens."""
    row = _clean(logits)
    out = np.zeros(row.size)
    with np.errstate(over="ignore", under="ignore"):
        candidates, probs = _truncated(row, temperature, top_p, top_k, min_p)
    out[candidates] = probs
    return out


def _truncated(
    row: F64, temperature: float, top_p: float, top_k: int, min_p: float
) -> tuple[npt.NDArray[np.intp], F64]:
    """The kept tokens, most likely first, and their renormalized probabilities."""
    # Shift first: the best token's value is exactly 0 after the division, the rest
    # are <= 0 or -inf; no temperature in (0, 2] can make an inf or a nan here.
    scaled = (row - np.max(row)) / temperature  # [V]
    candidates = np.arange(scaled.size)
    if 0 < top_k < scaled.size:
        candidates = np.argpartition(-scaled, top_k - 1)[:top_k]
    values = scaled[candidates]
    order = np.argsort(-values, kind="stable")
    candidates, values = candidates[order], values[order]
    probs = np.exp(values)  # probs[0] == 1: the sum is in [1, V]
    probs /= probs.sum()
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = max(1, int(np.searchsorted(np.cumsum(probs), top_p) + 1))
        candidates, probs = candidates[:keep], probs[:keep]
        probs /= probs.sum()
    if min_p > 0.0:
        keep = max(1, int(np.count_nonzero(probs >= min_p * probs[0])))
        candidates, probs = candidates[:keep], probs[:keep]  # sorted: a prefix
        probs /= probs.sum()
    return candidates, probs

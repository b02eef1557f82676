"""How far a quantized branch's next-token distributions are from the reference's.

The definitions are llama.cpp's ``llama-perplexity --kl-divergence``
(``tools/perplexity/perplexity.cpp``), computed in float64 and without its
16-bit compression of the reference log-probabilities:

- per token, ``KL(ref ‖ q) = Σ_v p_ref(v) · (log p_ref(v) - log q(v))``;
- "same top p": the reference's and the branch's argmax agree (ties go to the
  lowest token id, as llama.cpp's strict ``>`` scan does);
- ``Δp = p_q(correct) - p_ref(correct)`` for the token that actually follows;
- means carry a standard error ``sqrt(var / (n - 1))`` (reported as 0 for ten
  tokens or fewer, as llama.cpp does), top-1 agreement a binomial
  ``sigma = sqrt(p (1 - p) / (n - 1))``, percentiles interpolate linearly between
  sorted values.

Every function works on per-token rows, so a drift monitor can score the
teacher-forced tokens of one live request with the same code.

A remote branch lists only its top-k tokens per position (``top_logprobs``); its
rows are scored with :meth:`KldAccumulator.add_topk`, whose KLD is
:func:`~quantroute.divergence.kl_divergence_topk`'s lower bound of the full one.

>>> import numpy as np
>>> ref = log_softmax(np.array([[2.0, 0.0, -1.0]]))
>>> float(kl_divergence(ref, ref)[0])
0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from quantroute.divergence import (
    BLOCK_ELEMENTS,
    TopK,
    check_pair,
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

FloatArray = npt.NDArray[np.floating]
F64Array = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.integer]
BoolArray = npt.NDArray[np.bool_]

__all__ = [
    "BLOCK_ELEMENTS",
    "KldAccumulator",
    "QualityStats",
    "TopK",
    "kl_divergence",
    "kl_divergence_topk",
    "log_softmax",
    "percentile",
    "summarize",
    "tail_mass_topk",
    "token_logprob",
    "token_logprob_topk",
    "top1_agreement",
    "top1_agreement_topk",
    "top_k",
]


@dataclass(frozen=True, slots=True)
class QualityStats:
    """One branch's quality against the reference over ``n_tokens`` scored tokens.

    KLD values are in nats; ``top1`` and ``rms_dp`` are fractions (not %);
    ``ppl_*`` are perplexities; ``ln_ppl_ratio`` is ``ln(PPL(Q) / PPL(ref))``.
    Each ``*_stderr`` is one standard error, ``top1_sigma`` the binomial one.
    """

    n_tokens: int
    mean_kld: float
    kld_stderr: float
    kld_median: float
    kld_p90: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    top1: float
    top1_sigma: float
    ppl_q: float
    ppl_q_stderr: float
    ppl_ref: float
    ppl_ref_stderr: float
    ln_ppl_ratio: float
    ln_ppl_ratio_stderr: float
    mean_dp: float
    mean_dp_stderr: float
    rms_dp: float
    rms_dp_stderr: float


def _mean_stderr(x: F64Array) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: mean and ``sqrt(var / (n - 1))``, 0 if n <= 10."""
    n = len(x)
    if not np.isfinite(x).all():
        with np.errstate(invalid="ignore"):
            return float(x.mean()), math.inf
    mean = float(x.mean())
    var = float(np.mean((x - mean) ** 2))
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _exp(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)


def percentile(sorted_values: F64Array, fraction: float) -> float:
    """llama.cpp's percentile of ascending values: linear between ranks ``fraction·(n - 1)``.

    Unlike a plain lerp it never turns ``inf`` neighbours into NaN.
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("no values")
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    pos = fraction * (n - 1)
    i = int(pos)
    w = pos - i
    lo, hi = float(sorted_values[i]), float(sorted_values[min(i + 1, n - 1)])
    if w == 0.0 or lo == hi:
        return lo
    return (1.0 - w) * lo + w * hi


def summarize(
    kld: npt.ArrayLike,
    nll_q: npt.ArrayLike,
    nll_ref: npt.ArrayLike,
    same_top1: npt.ArrayLike,
) -> QualityStats:
    """Aggregate per-token values (each ``[T]``) into :class:`QualityStats`.

    ``nll_*`` are the negative log-probabilities each model gave the token that
    followed; ``same_top1`` is :func:`top1_agreement`'s output.
    """
    k = np.asarray(kld, dtype=np.float64)  # [T]
    nq = np.asarray(nll_q, dtype=np.float64)  # [T]
    nr = np.asarray(nll_ref, dtype=np.float64)  # [T]
    same = np.asarray(same_top1, dtype=bool)  # [T]
    n = len(k)
    if n == 0:
        raise ValueError("no tokens were scored")
    if not (k.shape == nq.shape == nr.shape == same.shape == (n,)):
        raise ValueError("per-token arrays must all be [T]")

    with np.errstate(over="ignore", invalid="ignore"):
        dp = np.exp(-nq) - np.exp(-nr)  # [T], Δp of the correct token
        mean_kld, kld_se = _mean_stderr(k)
        ln_q, ln_q_se = _mean_stderr(nq)
        ln_r, ln_r_se = _mean_stderr(nr)
        # llama.cpp's sqrt(se_q² + se_ref² - 2·cov) is the standard error of the
        # per-token difference; computed that way it is exactly 0 for identical inputs.
        _, ratio_se = _mean_stderr(nq - nr)
        mean_dp, mean_dp_se = _mean_stderr(dp)
        msd, msd_se = _mean_stderr(dp * dp)
        ppl_q, ppl_r = _exp(ln_q), _exp(ln_r)
    rms = math.sqrt(msd)
    top1 = float(same.mean())
    ks = np.sort(k)  # [T]
    return QualityStats(
        n_tokens=n,
        mean_kld=mean_kld,
        kld_stderr=kld_se,
        kld_median=percentile(ks, 0.5),
        kld_p90=percentile(ks, 0.90),
        kld_p99=percentile(ks, 0.99),
        kld_p999=percentile(ks, 0.999),
        kld_max=float(ks[-1]),
        top1=top1,
        top1_sigma=math.sqrt(top1 * (1.0 - top1) / (n - 1)) if n > 1 else 0.0,
        ppl_q=ppl_q,
        ppl_q_stderr=ppl_q * ln_q_se if ln_q_se else 0.0,
        ppl_ref=ppl_r,
        ppl_ref_stderr=ppl_r * ln_r_se if ln_r_se else 0.0,
        ln_ppl_ratio=ln_q - ln_r,
        ln_ppl_ratio_stderr=ratio_se,
        mean_dp=mean_dp,
        mean_dp_stderr=mean_dp_se,
        rms_dp=rms,
        rms_dp_stderr=0.5 / rms * msd_se if rms > 0 else 0.0,
    )


class KldAccumulator:
    """Streams ``[T, V]`` blocks of rows in and :class:`QualityStats` out.

    Only per-token values (five numbers a token) are kept, never the rows, so
    a long text over a large vocabulary is fed a chunk at a time; feeding the
    same rows in any split gives the same result as feeding them at once.

    >>> import numpy as np
    >>> acc = KldAccumulator()
    >>> ref = log_softmax(np.array([[3.0, 0.0], [0.0, 3.0]]))
    >>> acc.add(ref, ref, np.array([0, 1]))
    >>> acc.result().mean_kld, acc.result().top1
    (0.0, 1.0)
    """

    __slots__ = ("_kld", "_nll_q", "_nll_ref", "_same", "_tail")

    def __init__(self) -> None:
        self._kld: list[F64Array] = []
        self._nll_q: list[F64Array] = []
        self._nll_ref: list[F64Array] = []
        self._same: list[BoolArray] = []
        self._tail: list[F64Array] = []  # the reference's tail mass of rows added by add_topk

    @property
    def n_tokens(self) -> int:
        return sum(a.shape[0] for a in self._kld)

    def add(
        self, ref_logprobs: npt.ArrayLike, q_logprobs: npt.ArrayLike, targets: npt.ArrayLike
    ) -> None:
        """Score ``[T, V]`` rows of log-probabilities; ``targets`` ``[T]`` are the next tokens."""
        ref = np.asarray(ref_logprobs, dtype=np.float64)  # [T, V]
        q = np.asarray(q_logprobs, dtype=np.float64)  # [T, V]
        check_pair(ref, q)
        nll_q = -token_logprob(q, targets)  # [T]; validates targets before anything is kept
        nll_ref = -token_logprob(ref, targets)  # [T]
        self._kld.append(kl_divergence(ref, q))
        self._nll_q.append(nll_q)
        self._nll_ref.append(nll_ref)
        self._same.append(top1_agreement(ref, q))

    def add_logits(
        self, ref_logits: npt.ArrayLike, q_logits: npt.ArrayLike, targets: npt.ArrayLike
    ) -> None:
        """Like :meth:`add`, from raw ``[T, V]`` logits converted a block of rows at a time."""
        ref = np.asarray(ref_logits)  # [T, V]
        q = np.asarray(q_logits)  # [T, V]
        tok = np.asarray(targets)  # [T]
        check_pair(ref, q)
        if tok.shape != (ref.shape[0],):
            raise ValueError(f"expected {ref.shape[0]} targets, got shape {tok.shape}")
        step = max(1, BLOCK_ELEMENTS // max(1, ref.shape[1]))
        for lo in range(0, ref.shape[0], step):
            hi = lo + step
            self.add(log_softmax(ref[lo:hi]), log_softmax(q[lo:hi]), tok[lo:hi])

    def add_topk(self, ref_logprobs: npt.ArrayLike, q: TopK, targets: npt.ArrayLike) -> None:
        """Score a branch that lists only some tokens per row (a remote server's top-k)
        against the reference's full ``[T, V]`` log-probabilities.

        KLD is :func:`kl_divergence_topk`, a lower bound of the full KLD; top-1 agreement
        is exact; the branch's log-probability of each target is exact where it is
        listed (quantroute's remote client always lists it) and an upper bound where not
        (:func:`token_logprob_topk`), so PPL(Q) is then a lower bound.
        """
        ref = np.asarray(ref_logprobs, dtype=np.float64)  # [T, V]
        if ref.ndim != 2 or ref.shape[0] != q.n_rows:
            raise ValueError(f"expected [{q.n_rows}, V] reference rows, got {ref.shape}")
        nll_ref = -token_logprob(ref, targets)  # [T]; validates targets before anything is kept
        nll_q = -token_logprob_topk(q, targets)  # [T]
        self._kld.append(kl_divergence_topk(ref, q))
        self._nll_q.append(nll_q)
        self._nll_ref.append(nll_ref)
        self._same.append(top1_agreement_topk(ref, q))
        self._tail.append(tail_mass_topk(ref, q))

    def add_topk_logits(self, ref_logits: npt.ArrayLike, q: TopK, targets: npt.ArrayLike) -> None:
        """Like :meth:`add_topk`, from the reference's raw ``[T, V]`` logits, a block at a time."""
        ref = np.asarray(ref_logits)  # [T, V]
        tok = np.asarray(targets)  # [T]
        if ref.ndim != 2 or ref.shape[0] != q.n_rows or tok.shape != (q.n_rows,):
            raise ValueError(f"expected [{q.n_rows}, V] logits and {q.n_rows} targets")
        step = max(1, BLOCK_ELEMENTS // max(1, ref.shape[1]))
        for lo in range(0, ref.shape[0], step):
            hi = lo + step
            rows = TopK(q.ids[lo:hi], q.logprobs[lo:hi])
            self.add_topk(log_softmax(ref[lo:hi]), rows, tok[lo:hi])

    def mean_tail_mass(self) -> float:
        """The mean reference mass outside the branch's listed tokens, over the rows added
        by :meth:`add_topk` (0 if none): how much of each distribution the top-k missed."""
        return float(np.concatenate(self._tail).mean()) if self._tail else 0.0

    def per_token_kld(self) -> F64Array:
        """Every scored token's KLD so far, in the order added: ``[T]``."""
        return np.concatenate(self._kld) if self._kld else np.empty(0, dtype=np.float64)

    def result(self) -> QualityStats:
        """The statistics over everything added; ``ValueError`` if nothing was."""
        if not self._kld:
            raise ValueError("no tokens were scored")
        return summarize(
            np.concatenate(self._kld),
            np.concatenate(self._nll_q),
            np.concatenate(self._nll_ref),
            np.concatenate(self._same),
        )

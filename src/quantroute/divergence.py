"""The per-token math of fidelity: log-softmax, ``KL(ref ‖ q)`` and top-1 agreement,
from full rows of log-probabilities or from the few tokens a server lists (top-k).

A leaf: numpy only. Both the engines (a worker scores its rows against a reference's
logits) and :mod:`quantroute.quality` (profiles, drift) import it, so neither imports
the other for it. The definitions are llama.cpp's ``llama-perplexity --kl-divergence``,
computed in float64 (see :mod:`quantroute.quality.metrics` for the summaries).

>>> import numpy as np
>>> ref = log_softmax(np.array([[2.0, 0.0, -1.0]]))
>>> float(kl_divergence(ref, ref)[0])
0.0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]
F64Array = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

# Rows per internal block are chosen so that one float64 temporary stays near
# this many elements (32 MiB): a 150k vocabulary is scored ~28 rows at a time.
BLOCK_ELEMENTS = 1 << 22


def log_softmax(logits: npt.ArrayLike) -> F64Array:
    """Log-probabilities of ``logits`` along the last axis, in float64.

    Stable for widely spread logits (``[0, -1e4]`` stays ``[0, -1e4]``) and for
    ``-inf`` logits, which become ``-inf`` log-probabilities (probability 0).
    Raises ``ValueError`` for NaN or ``+inf`` logits, or a row without any
    finite logit: those are not distributions.
    """
    x = np.asarray(logits, dtype=np.float64)  # [..., V]
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("logits need a non-empty last (vocabulary) axis")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    top = x.max(axis=-1, keepdims=True)  # [..., 1]
    if np.isneginf(top).any():
        raise ValueError("a row of logits has no finite value")
    shifted = x - top  # [..., V], max 0, -inf stays -inf
    lse = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [..., 1], in [0, log V]
    out: F64Array = shifted - lse
    return out


def check_pair(ref_logprobs: FloatArray, q_logprobs: FloatArray) -> None:
    if ref_logprobs.ndim != 2 or ref_logprobs.shape != q_logprobs.shape:
        raise ValueError(
            f"expected two [T, V] arrays of the same shape, got {ref_logprobs.shape} "
            f"and {q_logprobs.shape}"
        )


def kl_divergence(ref_logprobs: npt.ArrayLike, q_logprobs: npt.ArrayLike) -> F64Array:
    """Per-token ``KL(ref ‖ q)`` in nats, shape ``[T]``.

    Both inputs are ``[T, V]`` log-probabilities (``log_softmax`` outputs).
    Tokens the reference gives probability 0 contribute nothing, whatever q
    says (``0 · log 0 = 0``); a token the reference gives mass and q gives
    ``-inf`` makes that row ``inf``, which is the true value. Results are
    clamped at 0: a negative KL is rounding, never information.
    """
    ref = np.asarray(ref_logprobs, dtype=np.float64)  # [T, V]
    q = np.asarray(q_logprobs, dtype=np.float64)  # [T, V]
    check_pair(ref, q)
    out = np.empty(ref.shape[0], dtype=np.float64)  # [T]
    step = max(1, BLOCK_ELEMENTS // max(1, ref.shape[1]))
    for lo in range(0, ref.shape[0], step):
        r = ref[lo : lo + step]  # [B, V]
        qb = q[lo : lo + step]  # [B, V]
        mass = r != -np.inf  # [B, V]; where the reference has no mass, skip (0 · log 0)
        terms = np.zeros_like(r)  # [B, V]
        np.subtract(r, qb, out=terms, where=mass)
        with np.errstate(invalid="ignore"):  # 0 · inf where p underflowed: fixed below
            np.multiply(np.exp(r), terms, out=terms, where=mass)
        row = terms.sum(axis=1)  # [B]
        # Mass where q has none is an infinite divergence even if p underflowed to 0.
        row[(mass & (qb == -np.inf)).any(axis=1)] = np.inf
        out[lo : lo + step] = row
    np.maximum(out, 0.0, out=out)
    return out


def top1_agreement(ref_logprobs: npt.ArrayLike, q_logprobs: npt.ArrayLike) -> BoolArray:
    """Per token, whether both distributions put their maximum on the same token: ``[T]``.

    Ties resolve to the lowest token id in each distribution separately.
    """
    ref = np.asarray(ref_logprobs)  # [T, V]
    q = np.asarray(q_logprobs)  # [T, V]
    check_pair(ref, q)
    same: BoolArray = np.argmax(ref, axis=1) == np.argmax(q, axis=1)  # [T]
    return same


def token_logprob(logprobs: npt.ArrayLike, tokens: npt.ArrayLike) -> F64Array:
    """The log-probability each row gives its token: ``logprobs[t, tokens[t]]``, shape ``[T]``."""
    lp = np.asarray(logprobs, dtype=np.float64)  # [T, V]
    tok = np.asarray(tokens)  # [T]
    if lp.ndim != 2 or tok.shape != (lp.shape[0],):
        raise ValueError(f"expected [T, V] log-probs and [T] tokens, got {lp.shape}, {tok.shape}")
    if not np.issubdtype(tok.dtype, np.integer):
        raise ValueError("tokens must be integers")
    if tok.size and (tok.min() < 0 or tok.max() >= lp.shape[1]):
        raise ValueError("a token id is outside the vocabulary")
    out: F64Array = np.take_along_axis(lp, tok[:, None].astype(np.intp), axis=1)[:, 0]
    return out


# ---- listed (top-k) distributions: what a remote server returns --------------------------------

# Listed log-probabilities come from float32 servers: a listed mass over 1 by this much is
# rounding, and a tail below TAIL_FLOOR cannot be resolved from 20 float32 probabilities.
LOGPROB_SLACK = 1e-5
TAIL_FLOOR = 1e-6


@dataclass(frozen=True, slots=True)
class TopK:
    """Some tokens' next-token log-probabilities at ``T`` positions, each exactly known.

    ``ids`` ``[T, K]`` (integers; ``-1`` where a row lists fewer than ``K`` tokens) and
    ``logprobs`` ``[T, K]`` (float64; ``-inf`` at the ``-1`` slots). A row's ids are
    distinct, in any order. This is what a server's ``top_logprobs`` give (its ``k``
    most likely tokens, often with the prompt's own token added), or :func:`top_k` of
    full rows. Log-probabilities up to :data:`LOGPROB_SLACK` above 0 (float32 rounding)
    are taken as 0; more, or NaN, is refused.
    """

    ids: npt.NDArray[np.int64]
    logprobs: F64Array

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids)
        lp = np.asarray(self.logprobs, dtype=np.float64)
        if ids.ndim != 2 or ids.shape != lp.shape:
            raise ValueError(f"expected [T, K] ids and log-probs, got {ids.shape}, {lp.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("ids must be integers")
        listed = ids >= 0  # [T, K]
        if np.isnan(lp[listed]).any() or (lp[listed] > LOGPROB_SLACK).any():
            raise ValueError("a listed log-probability is NaN or above 0")
        ordered = np.sort(np.where(listed, ids, -1), axis=1)  # [T, K]
        if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any():
            raise ValueError("a row lists the same token twice")
        object.__setattr__(self, "ids", np.where(listed, ids, -1).astype(np.int64))
        object.__setattr__(self, "logprobs", np.where(listed, np.minimum(lp, 0.0), -np.inf))

    @property
    def n_rows(self) -> int:
        return int(self.ids.shape[0])

    def top1(self) -> npt.NDArray[np.int64]:
        """Each row's most likely listed token (ties: the lowest id), ``-1`` if none: ``[T]``."""
        best = self.logprobs.max(axis=1, initial=-np.inf)  # [T]
        tie = (self.ids >= 0) & (self.logprobs == best[:, None])  # [T, K]
        big = np.iinfo(np.int64).max
        out: npt.NDArray[np.int64] = np.where(tie, self.ids, big).min(axis=1, initial=big)  # [T]
        out[out == big] = -1
        return out

    def listed_mass(self) -> F64Array:
        """Each row's total listed probability: ``[T]``."""
        out: F64Array = np.exp(self.logprobs).sum(axis=1)
        return out


def top_k(logprobs: npt.ArrayLike, k: int, *, also: npt.ArrayLike | None = None) -> TopK:
    """The ``k`` most likely tokens of each of ``[T, V]`` rows, largest first (ties: the
    lowest id first; a tie across the ``k``-th place keeps either), as a server lists them.

    ``also`` (``[T]`` token ids) adds each row's own token where it is not among the
    ``k``, as vLLM's prompt log-probabilities and quantroute's remote client do: the
    result then has ``k + 1`` columns.
    """
    lp = np.asarray(logprobs, dtype=np.float64)  # [T, V]
    if lp.ndim != 2 or lp.shape[1] == 0:
        raise ValueError(f"expected [T, V] log-probs, got {lp.shape}")
    if k < 1:
        raise ValueError("k must be at least 1")
    k = min(k, lp.shape[1])
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k]  # [T, k], unordered
    vals = np.take_along_axis(lp, part, axis=1)  # [T, k]
    order = np.lexsort((part, -vals), axis=-1)  # by value descending, then id
    ids = np.take_along_axis(part, order, axis=1).astype(np.int64)  # [T, k]
    vals = np.take_along_axis(vals, order, axis=1)
    if also is not None:
        tok = np.asarray(also, dtype=np.int64)  # [T]
        extra = token_logprob(lp, tok)  # [T]; validates the ids
        missing = ~(ids == tok[:, None]).any(axis=1)  # [T]
        ids = np.concatenate([ids, np.where(missing, tok, -1)[:, None]], axis=1)
        vals = np.concatenate([vals, np.where(missing, extra, -np.inf)[:, None]], axis=1)
    return TopK(ids, vals)


def _full_and_listed(ref: npt.ArrayLike | TopK, q: TopK) -> tuple[F64Array, BoolArray]:
    """The reference's log-probabilities at q's listed tokens, and where they are known."""
    if isinstance(ref, TopK):
        if ref.n_rows != q.n_rows:
            raise ValueError(f"{ref.n_rows} reference rows against {q.n_rows}")
        eq = (ref.ids[:, :, None] == q.ids[:, None, :]) & (q.ids[:, None, :] >= 0)  # [T, Kr, Kq]
        known = eq.any(axis=1)  # [T, Kq]
        lp = np.where(eq, ref.logprobs[:, :, None], -np.inf).max(axis=1)  # [T, Kq]
        return lp, known
    full = np.asarray(ref, dtype=np.float64)  # [T, V]
    if full.ndim != 2 or full.shape[0] != q.n_rows:
        raise ValueError(f"expected [{q.n_rows}, V] reference log-probs, got {full.shape}")
    if q.ids.max(initial=-1) >= full.shape[1]:
        raise ValueError("a listed token id is outside the vocabulary")
    known = q.ids >= 0  # [T, Kq]
    lp = np.take_along_axis(full, np.maximum(q.ids, 0), axis=1)  # [T, Kq]
    return np.where(known, lp, -np.inf), known


def kl_divergence_topk(ref: npt.ArrayLike | TopK, q: TopK) -> F64Array:
    """Per-token ``KL(ref ‖ q)`` estimated from listed tokens, in nats: ``[T]``.

    ``ref`` is either the reference's full ``[T, V]`` log-probabilities (a local
    reference) or its own :class:`TopK` (a remote one); ``q`` is the branch's listed
    tokens.

    **The estimator: matched tokens plus one tail bucket.** Let ``M`` be the tokens whose
    probability both sides state (q's listed tokens; with a listed reference, those it
    lists too). Collapse every other token into one bucket, whose mass is what the
    listed tokens leave: ``P_rest = 1 - Σ_M p``, ``Q_rest = 1 - Σ_M q``. The estimate is
    the KL divergence of the two ``(|M| + 1)``-bucket distributions::

        KL_M = Σ_{v∈M} p(v) log(p(v) / q(v))  +  P_rest log(P_rest / Q_rest)

    **It is a lower bound of the full KL.** By the chain rule, for this partition
    ``KL(p ‖ q) = KL_M + P_rest · KL(p(·|rest) ‖ q(·|rest))``, and the second term is
    ``≥ 0`` (log-sum inequality; data processing). The gap is exactly that term: the
    divergence *inside* the tail, weighted by the reference's tail mass. From listed
    tokens alone it has no upper bound (q may give a token of the reference's tail
    arbitrarily little mass), so an estimate never overstates and may understate;
    :func:`tail_mass_topk` gives ``P_rest`` per token, which caps how much of the
    reference can be mis-scored. Equality holds when q's listed tokens carry all of q's
    mass and the reference's outside ``M`` is zero, or when both tails are proportional
    (``p(v|rest) = q(v|rest)``): in particular ``ref == q`` gives 0.

    Rounding: masses clamp at 0, and ``Q_rest`` is at least :data:`TAIL_FLOOR` (a
    listed mass that rounds to 1 leaves an unresolvable tail, not none); raising
    ``Q_rest`` only lowers the estimate, so it stays a lower bound. A token of ``M``
    that the reference gives mass and q lists at ``-inf`` makes the row ``inf``.
    """
    lp, known = _full_and_listed(ref, q)  # [T, K]
    lq = q.logprobs  # [T, K]
    with np.errstate(all="ignore"):
        p = np.where(known, np.exp(lp), 0.0)  # [T, K]
        qm = np.where(known, np.exp(lq), 0.0)  # [T, K]
        terms = np.where(p > 0, p * (lp - lq), 0.0)  # lq = -inf with p > 0: inf, the truth
        p_rest = np.maximum(1.0 - p.sum(axis=1), 0.0)  # [T]
        q_rest = np.maximum(1.0 - qm.sum(axis=1), TAIL_FLOOR)  # [T]
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)  # [T]
        out: F64Array = terms.sum(axis=1) + rest
    np.maximum(out, 0.0, out=out)
    return out


def tail_mass_topk(ref: npt.ArrayLike | TopK, q: TopK) -> F64Array:
    """The reference's mass outside the matched tokens, ``P_rest`` of
    :func:`kl_divergence_topk`: ``[T]``. What the estimate can miss is the divergence
    inside this mass."""
    lp, known = _full_and_listed(ref, q)
    out: F64Array = np.maximum(1.0 - np.where(known, np.exp(lp), 0.0).sum(axis=1), 0.0)
    return out


def top1_agreement_topk(ref: npt.ArrayLike | TopK, q: TopK) -> BoolArray:
    """Per token, whether the reference's and the branch's most likely tokens agree: ``[T]``.

    Exact whenever each side lists its most likely token, as every top-``k`` list with
    ``k ≥ 1`` does (ties: the lowest id, as :func:`top1_agreement`; a server that breaks
    a tie otherwise can differ there). A row where either side lists nothing disagrees.
    """
    if isinstance(ref, TopK):
        if ref.n_rows != q.n_rows:
            raise ValueError(f"{ref.n_rows} reference rows against {q.n_rows}")
        ref_top = ref.top1()  # [T]
    else:
        full = np.asarray(ref)  # [T, V]
        if full.ndim != 2 or full.shape[0] != q.n_rows:
            raise ValueError(f"expected [{q.n_rows}, V] reference log-probs, got {full.shape}")
        ref_top = np.argmax(full, axis=1)
    q_top = q.top1()  # [T]
    same: BoolArray = (ref_top == q_top) & (q_top >= 0) & (ref_top >= 0)
    return same


def token_logprob_topk(q: TopK, tokens: npt.ArrayLike) -> F64Array:
    """The log-probability q gives each row's token: exact where it is listed, otherwise
    its upper bound ``log min(smallest listed, 1 - listed mass)`` (the token is outside
    a top-``k`` list, so it is no likelier than the list's last one, nor than the rest
    together): ``[T]``. An upper bound of ``log q`` makes a perplexity from it a lower bound.
    """
    tok = np.asarray(tokens)  # [T]
    if tok.shape != (q.n_rows,) or (tok.size and not np.issubdtype(tok.dtype, np.integer)):
        raise ValueError(f"expected {q.n_rows} integer tokens, got {tok.shape}")
    hit = q.ids == tok[:, None]  # [T, K]
    exact = np.where(hit, q.logprobs, -np.inf).max(axis=1)  # [T]
    listed = q.ids >= 0
    with np.errstate(divide="ignore"):
        smallest = np.where(listed, q.logprobs, np.inf).min(axis=1)  # [T]
        rest = np.log(np.maximum(1.0 - q.listed_mass(), TAIL_FLOOR))  # [T]
    bound = np.minimum(np.where(np.isfinite(smallest), smallest, 0.0), rest)
    out: F64Array = np.where(hit.any(axis=1), exact, bound)
    return out

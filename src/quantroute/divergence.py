"""The per-token math of fidelity: log-softmax, ``KL(ref ‖ q)`` and top-1 agreement.

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

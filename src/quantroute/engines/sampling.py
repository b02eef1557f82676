"""Next-token choice from one row of logits: greedy, temperature, top-k, top-p.

Pure numpy, called by the llama.cpp worker once per sequence per step.
Log-probabilities reported to clients are the model's own distribution
(temperature 1, no truncation), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Choice:
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: FloatArray) -> npt.NDArray[np.float64]:
    """Stable log-softmax over a [V] row; ``-inf`` logits stay ``-inf``."""
    row = logits.astype(np.float64)
    peak = np.max(row)
    shifted = row - peak
    result: npt.NDArray[np.float64] = shifted - np.log(np.sum(np.exp(shifted)))
    return result


def sample(
    logits: FloatArray,  # [V]
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    rng: np.random.Generator,
    want_logprob: bool = False,
    n_top: int = 0,
) -> Choice:
    if temperature <= 0.0:
        token = int(np.argmax(logits))
    else:
        token = _sample_stochastic(logits, temperature, top_p, top_k, rng)
    if not (want_logprob or n_top):
        return Choice(token, None, ())
    logprobs = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        idx = np.argpartition(-logprobs, min(n_top, logprobs.size - 1))[:n_top]
        idx = idx[np.argsort(-logprobs[idx], kind="stable")]
        top = tuple((int(i), float(logprobs[i])) for i in idx)
    return Choice(token, float(logprobs[token]), top)


def _sample_stochastic(
    logits: FloatArray, temperature: float, top_p: float, top_k: int, rng: np.random.Generator
) -> int:
    scaled = logits.astype(np.float64) / temperature
    candidates = np.arange(scaled.size)
    if 0 < top_k < scaled.size:
        candidates = np.argpartition(-scaled, top_k - 1)[:top_k]
    values = scaled[candidates]
    order = np.argsort(-values, kind="stable")
    candidates, values = candidates[order], values[order]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        candidates, probs = candidates[:keep], probs[:keep]
        probs /= probs.sum()
    return int(candidates[rng.choice(probs.size, p=probs)])

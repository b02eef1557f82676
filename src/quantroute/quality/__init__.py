"""Quality: how far each branch's next-token distributions are from the reference's.

- :mod:`~quantroute.quality.metrics`: per-token KL divergence, top-1
  agreement, token log-probabilities, and the streaming accumulator that
  turns them into llama-perplexity's statistics.
- :mod:`~quantroute.quality.profile`: ``profile.json``, keyed by artifact sha256.
- :mod:`~quantroute.quality.profiler`: ``quantroute profile``, which measures
  quality, footprint and speed of every branch with llama.cpp.

llama-cpp-python and matplotlib are imported only when a profile is measured
or drawn, so the gateway reads profiles without loading either.
"""

from __future__ import annotations

from quantroute.quality.drift import (
    Baseline,
    DriftMonitor,
    DriftState,
    DriftWindow,
    LogitsFiles,
    Replay,
    Scorer,
    WindowResult,
    judge,
)
from quantroute.quality.metrics import (
    KldAccumulator,
    QualityStats,
    kl_divergence,
    log_softmax,
    summarize,
    token_logprob,
    top1_agreement,
)
from quantroute.quality.profile import (
    PROFILE_NAME,
    BranchProfile,
    ProfileMethod,
    load_profiles,
    stale_profiles,
)
from quantroute.quality.profiler import (
    ModelProfileResult,
    ProfileResult,
    default_calibration_text,
    find_model_dirs,
    format_table,
    profile_model,
    profile_repo,
)

__all__ = [
    "PROFILE_NAME",
    "Baseline",
    "BranchProfile",
    "DriftMonitor",
    "DriftState",
    "DriftWindow",
    "KldAccumulator",
    "LogitsFiles",
    "ModelProfileResult",
    "ProfileMethod",
    "ProfileResult",
    "QualityStats",
    "Replay",
    "Scorer",
    "WindowResult",
    "default_calibration_text",
    "find_model_dirs",
    "format_table",
    "judge",
    "kl_divergence",
    "load_profiles",
    "log_softmax",
    "profile_model",
    "profile_repo",
    "stale_profiles",
    "summarize",
    "token_logprob",
    "top1_agreement",
]

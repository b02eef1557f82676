"""A branch's measured profile as ``GET /v1/models`` shows it (``api/views.py``)."""

from __future__ import annotations

import math
from typing import Any

from quantroute.quality.profile import BranchProfile, Measure


def profile_state(profile: BranchProfile | None, stale: bool) -> str:
    """``stale``, ``declared`` (the manifest's numbers), ``measured`` or ``unprofiled``."""
    if stale:
        return "stale"
    if profile is None:
        return "unprofiled"
    return "declared" if profile.fidelity.measure is Measure.DECLARED else "measured"


def profile_json(profile: BranchProfile | None) -> dict[str, Any] | None:
    """What ``quantroute profile`` measured of the branch (or its manifest declared, where
    a remote cannot be measured); ``None``: nothing. A figure nobody stated is ``null``."""
    if profile is None:
        return None
    q = profile.quality
    f = profile.fidelity
    body = {
        "mean_kld": q.mean_kld,
        "kld_stderr": q.kld_stderr,
        "kld_p99": q.kld_p99,
        "top1": q.top1,
        "top1_sigma": q.top1_sigma,
        "ppl": q.ppl_q,
        "ln_ppl_ratio": q.ln_ppl_ratio,
        "rms_dp": q.rms_dp,
        "n_tokens": q.n_tokens,
        "decode_tps": profile.decode_tps,
        "prefill_tps": profile.prefill_tps,
        "rss_bytes": profile.rss_bytes,
        "measured_at": profile.measured_at.isoformat(),
        "measure": f.measure.value,  # full, topk (KLD a lower bound) or declared
        "top_k": f.top_k or None,
        "tail_mass": f.tail_mass if f.measure is Measure.TOPK else None,
    }
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in body.items()
    }

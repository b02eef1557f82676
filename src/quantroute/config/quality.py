"""``Settings.drift``: the run-time drift monitor (``quality/drift.py``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DriftSettings(BaseModel):
    """The run-time drift monitor: live requests replayed through the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(
        0.02, ge=0, le=1, description="Share of finished requests replayed (when there is room)."
    )
    window_tokens: int = Field(256, ge=8, description="Scored tokens per drift window.")
    windows_to_flag: int = Field(
        3, ge=1, description="Consecutive out-of-bounds windows that mark a branch degraded."
    )
    windows_to_recover: int = Field(
        3, ge=1, description="Consecutive in-bounds windows that clear the mark."
    )
    kld_delta: float = Field(
        0.05,
        gt=0,
        description="δ: a window is out of bounds when its mean KLD exceeds the "
        "profiled mean KLD by more than this.",
    )
    top1_delta: float = Field(
        0.05, gt=0, le=1, description="Δ: ...or its top-1 agreement is this far below the profile."
    )
    queue: int = Field(8, ge=1, description="Replays waiting at most; more are dropped.")
    max_tokens: int = Field(
        256, ge=1, description="Longest generated text replayed (its first tokens)."
    )

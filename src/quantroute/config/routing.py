"""``Settings.routing``: the tiers a request may name, the memory regimes, the score's
weights and the observed speeds (``routing/``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 1 << 30


class Tier(StrEnum):
    """The quality tiers a request may name in ``quality`` or ``x-quantroute-quality``."""

    EXACT = "exact"
    HIGH = "high"
    BALANCED = "balanced"
    FAST = "fast"


OnInfeasible = Literal["wait", "reject", "best_effort"]
Speculation = Literal["auto", "always", "off"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierSettings(_Frozen):
    """One tier's quality bounds and what happens when no branch can meet them now."""

    max_kld: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Largest profiled mean KL divergence from the reference (nats/token); "
        "0 admits only the reference; unset means no KLD bound.",
    )
    min_top1: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Smallest profiled top-1 agreement with the reference; unset means no bound.",
    )
    on_infeasible: OnInfeasible = Field(
        default="reject",
        description="When no branch is feasible: 'wait' (the caller waits up to wait_s and "
        "retries, then 503), 'reject' (503 with Retry-After) or 'best_effort' (the cheapest "
        "ready branch, ignoring memory and deadline; only for a tier without bounds).",
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=600,
        description="Longest wait for a feasible branch when on_infeasible is 'wait'.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TierSettings:
        if self.on_infeasible == "wait" and self.wait_s <= 0:
            raise ValueError("on_infeasible 'wait' needs wait_s > 0")
        if self.on_infeasible == "best_effort" and (
            self.max_kld is not None or self.min_top1 is not None
        ):
            raise ValueError(
                "on_infeasible 'best_effort' would break the tier's own bounds; "
                "use it only for a tier without max_kld and min_top1"
            )
        return self

    @property
    def bounded(self) -> bool:
        """Whether the tier has any quality bound."""
        return self.max_kld is not None or self.min_top1 is not None


# Each tier's defaults, in one place: a partial override (``QUANTROUTE_ROUTING__TIERS__HIGH__
# MAX_KLD=0.005``) is merged with them, so it does not reset the tier's other bound.
_TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "exact": {"max_kld": 0.0, "on_infeasible": "wait", "wait_s": 5.0},
    "high": {"max_kld": 0.001, "min_top1": 0.98},
    "balanced": {"max_kld": 0.02, "min_top1": 0.90},
    "fast": {"on_infeasible": "best_effort"},
}


class TiersSettings(_Frozen):
    """The four tiers. ``exact`` admits only the reference; ``fast`` admits anything ready.

    A tier given in part keeps its other defaults; set a bound to ``null`` to remove it.
    """

    exact: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["exact"]),
        description="Only the reference (max_kld 0); when it cannot serve now, wait for it.",
    )
    high: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["high"]),
        description="Near-lossless branches; 503 when none can serve now.",
    )
    balanced: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["balanced"]),
        description="The default tier: small measured loss; 503 when none can serve now.",
    )
    fast: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["fast"]),
        description="No quality bound; when nothing is feasible, the cheapest ready branch.",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            name: {**_TIER_DEFAULTS[name], **given}
            if name in _TIER_DEFAULTS and isinstance(given, dict)
            else given
            for name, given in data.items()
        }

    def get(self, tier: Tier) -> TierSettings:
        """The settings of ``tier``."""
        result: TierSettings = getattr(self, tier.value)
        return result


class ScoreWeights(_Frozen):
    """Weights of the score terms; each term lies in [0, 1], higher is better.

    ``fit`` is the memory-regime fit and dominates by default: the other terms
    (summing to 0.75) shift the choice between branches whose fit is close,
    e.g. away from a saturated branch to an idle one a step down.
    """

    fit: float = Field(
        default=1.0, ge=0, description="Memory-regime fit (precision vs free memory)."
    )
    headroom: float = Field(
        default=0.1,
        ge=0,
        description="Device memory left after admitting the request, / device total.",
    )
    load: float = Field(
        default=0.3,
        ge=0,
        description="1 - load: sequences running and queued against parallel slots.",
    )
    latency: float = Field(
        default=0.1, ge=0, description="Deadline slack: 1 - predicted latency / deadline."
    )
    health: float = Field(default=0.2, ge=0, description="Device health factor in [0, 1].")
    heat: float = Field(default=0.05, ge=0, description="1 - device thermal pressure in [0, 1].")


class SpeedSettings(_Frozen):
    """Each branch's live end-to-end speed, which the deadline filter predicts with
    (``routing/speeds.py``)."""

    weight: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Weight of a finished request in a branch's observed TTFT and time per "
        "output token (an exponentially weighted mean).",
    )
    max_age_s: float = Field(
        default=60.0,
        gt=0,
        description="A branch's observed speed is dropped after this long without a finished "
        "request; the deadline filter then reads the profile again.",
    )
    margin_deviations: float = Field(
        default=0.0,
        ge=0,
        description="With a deadline, branches whose observed prediction plus this many "
        "deviations still meets it go first; the others (in time only on average) follow "
        "as fallbacks. 0 (the default): no margin; 2 is a TCP-like choice.",
    )
    reach_deviations: float = Field(
        default=2.0,
        ge=0,
        description="With a deadline and no branch predicted in time, the branches that fail "
        "only the deadline and whose observed prediction minus this many deviations still "
        "meets it are tried, fastest first, instead of a 503 (the prediction is a mean, and "
        "a request is cut at its deadline). 0: a predicted miss is always a 503.",
    )


class RoutingSettings(_Frozen):
    """How the policy maps a request's requirement and the live state to a branch."""

    tiers: TiersSettings = Field(
        default_factory=lambda: TiersSettings(), description="Quality bounds of the named tiers."
    )
    default_tier: Tier = Field(
        default=Tier.BALANCED, description="Tier of a request that states no quality requirement."
    )
    ample_free_bytes: int = Field(
        default=8 * GiB,
        ge=0,
        description="A device with at least this much free memory is in the ample regime: "
        "the most faithful feasible branch fits best.",
    )
    tight_free_bytes: int = Field(
        default=4 * GiB,
        ge=0,
        description="Below this much free memory a device is tight: the cheapest feasible "
        "branch fits best. Between tight and ample it is constrained.",
    )
    constrained_cost_ratio: float = Field(
        default=0.6,
        gt=0,
        le=1,
        description="In the constrained regime, the most faithful branch whose bits per weight "
        "are at most this fraction of the reference's fits best.",
    )
    fit_decay: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Fit multiplier per step down the fidelity order of the feasible branches.",
    )
    weights: ScoreWeights = Field(
        default_factory=lambda: ScoreWeights(), description="Weights of the score terms."
    )
    load_saturation: float = Field(
        default=2.0,
        gt=0,
        description="(running + queued) / parallel at which the load term reaches 0.",
    )
    top_k: int = Field(
        default=2,
        ge=1,
        le=16,
        description="Most branches among which prompt-prefix affinity breaks a near tie.",
    )
    tie_epsilon: float = Field(
        default=0.02,
        ge=0,
        description="Scores within this of the best are a near tie, broken by prefix affinity.",
    )
    retry_after_s: float = Field(
        default=2.0,
        gt=0,
        description="Retry-After of a 503 when no branch can meet the requirement.",
    )
    residency: bool = Field(
        default=True,
        description="Unload branches when their device runs out of memory and load them back "
        "when it has room again (see routing/residency.py).",
    )
    reload_margin_bytes: int = Field(
        default=GiB // 2,
        ge=0,
        description="Room beyond its footprint a device needs before an unloaded branch is "
        "loaded again (hysteresis).",
    )
    speeds: SpeedSettings = Field(
        default_factory=lambda: SpeedSettings(),
        description="Observed end-to-end speeds for the deadline filter.",
    )
    speculation: Speculation = Field(
        default="auto",
        description="Speculative decoding on a model's reference: 'auto' (its worker holds the "
        "model's cheapest other GGUF branch as a draft and drafts while it pays), 'always' "
        "(drafts at least one token a step) or 'off' (no draft loaded).",
    )
    speculation_k_max: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Most tokens the draft proposes per step of the reference.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> RoutingSettings:
        if self.tight_free_bytes > self.ample_free_bytes:
            raise ValueError("tight_free_bytes must not exceed ample_free_bytes")
        return self

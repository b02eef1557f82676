"""Routing settings: ``Settings.routing`` of the settings tree in ``config.py``
(the tiers a request may name, the memory regimes, the score's weights)."""

from __future__ import annotations

from quantroute.config import (
    GiB,
    OnInfeasible,
    RoutingSettings,
    ScoreWeights,
    Tier,
    TierSettings,
    TiersSettings,
)

__all__ = [
    "GiB",
    "OnInfeasible",
    "RoutingSettings",
    "ScoreWeights",
    "Tier",
    "TierSettings",
    "TiersSettings",
]

"""What a request asks of quality and time, parsed from its body and headers.

Where it comes from:

============================  ==============================================================
``quality`` (body)            a tier name (``exact``, ``high``, ``balanced``, ``fast``) or an
                              object ``{"max_kld": 0.01, "min_top1": 0.95}`` (either or both;
                              ``max_kld`` in [0, 10], ``min_top1`` in [0, 1])
``x-quantroute-quality``      a tier name, or ``max_kld=0.01,min_top1=0.95`` (either or both)
``x-quantroute-deadline-ms``  milliseconds the client will wait, 1 to 3,600,000
``timeout`` (body)            the same in seconds, 0.001 to 3,600
============================  ==============================================================

Without a quality requirement the configured default tier applies and
``explicit`` is false. Body and header may both carry one only if they say the
same thing (the same tier, or the same bounds); otherwise the request is a
400. Both deadline forms may be given: the earlier deadline counts, as when a
deadline passes through a proxy that adds its own.

Every malformed or out-of-range value is an :class:`InvalidRequestError` with
``param`` naming the field or header; its message states the rule and never
repeats the value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quantroute.errors import InvalidRequestError
from quantroute.routing.settings import RoutingSettings, Tier

__all__ = [
    "DEADLINE_HEADER",
    "DEADLINE_MS_MAX",
    "DEADLINE_MS_MIN",
    "QUALITY_HEADER",
    "Requirement",
    "parse_requirement",
]

QUALITY_HEADER = "x-quantroute-quality"
DEADLINE_HEADER = "x-quantroute-deadline-ms"
DEADLINE_MS_MIN = 1.0
DEADLINE_MS_MAX = 3_600_000.0
MAX_KLD_MAX = 10.0

# A plain decimal (scientific notation allowed: KLD bounds are small); rejects
# nan, inf, signs, underscores and hex, all of which float() would accept.
_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]{1,3})?|\.[0-9]+([eE][-+]?[0-9]{1,3})?")
_BOUND_KEYS = ("max_kld", "min_top1")


@dataclass(frozen=True, slots=True)
class Requirement:
    """A request's quality bounds and deadline.

    ``tier`` is the named tier the bounds came from (``None`` for bounds given
    as numbers); ``max_kld`` / ``min_top1`` are the resolved bounds (``None``:
    no bound). ``explicit`` says the request stated its quality itself, by
    tier or bounds, rather than getting the default tier.

    >>> Requirement(Tier.FAST, None, None, None).bounded
    False
    """

    tier: Tier | None
    max_kld: float | None
    min_top1: float | None
    deadline_ms: float | None
    explicit: bool = False

    @property
    def bounded(self) -> bool:
        """Whether any quality bound applies."""
        return self.max_kld is not None or self.min_top1 is not None


_Quality = tuple[Tier | None, float | None, float | None]


def parse_requirement(
    body_quality: object,
    header_quality: str | None,
    header_deadline_ms: str | None,
    timeout_s: object,
    settings: RoutingSettings,
) -> Requirement:
    """The requirement of one request; ``None`` means the field or header is absent.

    >>> s = RoutingSettings()
    >>> r = parse_requirement(None, "max_kld=0.01", "250", None, s)
    >>> r.tier, r.max_kld, r.min_top1, r.deadline_ms, r.explicit
    (None, 0.01, None, 250.0, True)
    >>> parse_requirement(None, None, None, None, s).tier
    <Tier.BALANCED: 'balanced'>
    """
    body = None if body_quality is None else _body_quality(body_quality, settings)
    header = None if header_quality is None else _header_quality(header_quality, settings)
    if body is not None and header is not None and body != header:
        raise InvalidRequestError(
            f"quality and the {QUALITY_HEADER} header disagree; give one, or the same in both",
            param="quality",
        )
    quality = body if body is not None else header
    explicit = quality is not None
    if quality is None:
        quality = _tier(settings.default_tier, settings)
    deadline = _deadline(header_deadline_ms, timeout_s)
    return Requirement(
        tier=quality[0],
        max_kld=quality[1],
        min_top1=quality[2],
        deadline_ms=deadline,
        explicit=explicit,
    )


# ---- quality ----------------------------------------------------------------------------------


def _tier(tier: Tier, settings: RoutingSettings) -> _Quality:
    bounds = settings.tiers.get(tier)
    return tier, bounds.max_kld, bounds.min_top1


def _tier_named(name: str, param: str, settings: RoutingSettings) -> _Quality:
    try:
        tier = Tier(name.strip().lower())
    except ValueError:
        raise InvalidRequestError(
            f"{param} must name a tier ({', '.join(t.value for t in Tier)}) "
            "or give max_kld and/or min_top1",
            param=param,
        ) from None
    return _tier(tier, settings)


def _bound(key: str, value: float, param: str) -> float:
    high = MAX_KLD_MAX if key == "max_kld" else 1.0
    if not (math.isfinite(value) and 0.0 <= value <= high):
        raise InvalidRequestError(f"{param}: {key} must be a number in [0, {high:g}]", param=param)
    return value


def _body_quality(value: object, settings: RoutingSettings) -> _Quality:
    if isinstance(value, str):
        return _tier_named(value, "quality", settings)
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "quality must be a tier name or an object with max_kld and/or min_top1",
            param="quality",
        )
    if not value or any(k not in _BOUND_KEYS for k in value):
        raise InvalidRequestError(
            "quality as an object takes max_kld and/or min_top1 and nothing else",
            param="quality",
        )
    bounds: dict[str, float] = {}
    for key, raw in value.items():
        number = _number(raw)
        if number is None:
            raise InvalidRequestError(f"quality.{key} must be a number", param=f"quality.{key}")
        bounds[key] = _bound(key, number, f"quality.{key}")
    return None, bounds.get("max_kld"), bounds.get("min_top1")


def _number(value: object) -> float | None:
    """A JSON number as a float: ``None`` for anything else (booleans included), ``nan``
    for an integer too big for a float (``10**400``), so that its range check fails
    rather than ``float()`` raising."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _header_quality(value: str, settings: RoutingSettings) -> _Quality:
    if "=" not in value:
        return _tier_named(value, QUALITY_HEADER, settings)
    bounds: dict[str, float] = {}
    for part in value.split(","):
        key, sep, raw = (s.strip() for s in part.partition("="))
        if not sep or key not in _BOUND_KEYS or key in bounds or not _NUMBER.fullmatch(raw):
            raise InvalidRequestError(
                f"{QUALITY_HEADER} must be a tier name or 'max_kld=NUMBER,min_top1=NUMBER' "
                "(either or both, each once)",
                param=QUALITY_HEADER,
            )
        bounds[key] = _bound(key, float(raw), QUALITY_HEADER)
    return None, bounds.get("max_kld"), bounds.get("min_top1")


# ---- deadline --------------------------------------------------------------------


def _deadline(header: str | None, timeout_s: object) -> float | None:
    deadlines: list[float] = []
    if header is not None:
        raw = header.strip()
        ms = float(raw) if _NUMBER.fullmatch(raw) else math.nan
        if not DEADLINE_MS_MIN <= ms <= DEADLINE_MS_MAX:  # nan fails too
            raise InvalidRequestError(
                f"{DEADLINE_HEADER} must be a number of milliseconds from "
                f"{DEADLINE_MS_MIN:g} to {DEADLINE_MS_MAX:.0f}",
                param=DEADLINE_HEADER,
            )
        deadlines.append(ms)
    if timeout_s is not None:
        seconds = _number(timeout_s)
        ms = math.nan if seconds is None else seconds * 1000.0
        if not DEADLINE_MS_MIN <= ms <= DEADLINE_MS_MAX:  # nan and inf fail too
            raise InvalidRequestError(
                f"timeout must be a number of seconds from {DEADLINE_MS_MIN / 1000:g} "
                f"to {DEADLINE_MS_MAX / 1000:.0f}",
                param="timeout",
            )
        deadlines.append(ms)
    return min(deadlines) if deadlines else None

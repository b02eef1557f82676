"""Requirement parsing: tiers, bounds, headers, deadlines; 400s that never echo."""

from __future__ import annotations

import doctest
import importlib
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from quantroute.errors import InvalidRequestError
from quantroute.routing.requirement import (
    DEADLINE_HEADER,
    QUALITY_HEADER,
    Requirement,
    parse_requirement,
)
from quantroute.routing.settings import RoutingSettings, Tier, TierSettings

S = RoutingSettings()


def parse(
    body: object = None,
    header: str | None = None,
    deadline: str | None = None,
    timeout: object = None,
    settings: RoutingSettings = S,
) -> Requirement:
    return parse_requirement(body, header, deadline, timeout, settings)


# ---- quality: what parses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "header", "expected"),
    [
        # (tier, max_kld, min_top1, explicit)
        (None, None, (Tier.BALANCED, 0.02, 0.90, False)),
        ("exact", None, (Tier.EXACT, 0.0, None, True)),
        ("high", None, (Tier.HIGH, 0.001, 0.98, True)),
        ("balanced", None, (Tier.BALANCED, 0.02, 0.90, True)),
        ("fast", None, (Tier.FAST, None, None, True)),
        (" High ", None, (Tier.HIGH, 0.001, 0.98, True)),
        ({"max_kld": 0.01}, None, (None, 0.01, None, True)),
        ({"min_top1": 0.95}, None, (None, None, 0.95, True)),
        ({"max_kld": 0, "min_top1": 1}, None, (None, 0.0, 1.0, True)),
        ({"max_kld": 10.0}, None, (None, 10.0, None, True)),
        (None, "exact", (Tier.EXACT, 0.0, None, True)),
        (None, "FAST", (Tier.FAST, None, None, True)),
        (None, "max_kld=0.01,min_top1=0.95", (None, 0.01, 0.95, True)),
        (None, " min_top1 = 0.9 ", (None, None, 0.9, True)),
        (None, "max_kld=1e-3", (None, 0.001, None, True)),
        (None, "max_kld=.5", (None, 0.5, None, True)),
        # body and header may both be given when they say the same
        ("high", "high", (Tier.HIGH, 0.001, 0.98, True)),
        ({"max_kld": 0.01}, "max_kld=0.01", (None, 0.01, None, True)),
    ],
)
def test_quality_parses(
    body: object, header: str | None, expected: tuple[Tier | None, float | None, float | None, bool]
) -> None:
    r = parse(body, header)
    assert (r.tier, r.max_kld, r.min_top1, r.explicit) == expected
    assert r.deadline_ms is None


def test_tier_bounds_and_default_tier_come_from_settings() -> None:
    settings = RoutingSettings.model_validate(
        {"default_tier": "high", "tiers": {"high": {"max_kld": 0.005, "min_top1": 0.97}}}
    )
    assert (parse(settings=settings).tier, parse(settings=settings).max_kld) == (Tier.HIGH, 0.005)
    assert parse(settings=settings).explicit is False
    assert parse("high", settings=settings).min_top1 == 0.97


def test_bounded() -> None:
    assert parse("high").bounded and parse({"min_top1": 0.5}).bounded
    assert not parse("fast").bounded


# ---- quality: what is refused -----------------------------------------------------------------

SECRET = "zq-secret-917"


@pytest.mark.parametrize(
    ("body", "header", "param"),
    [
        (f"ultra-{SECRET}", None, "quality"),
        ("", None, "quality"),
        (5, None, "quality"),
        (True, None, "quality"),
        ([0.01], None, "quality"),
        ({}, None, "quality"),
        ({SECRET: 1}, None, "quality"),
        ({"max_kld": 0.1, "extra": 1}, None, "quality"),
        ({"max_kld": "0.1"}, None, "quality.max_kld"),
        ({"max_kld": True}, None, "quality.max_kld"),
        ({"max_kld": None}, None, "quality.max_kld"),
        ({"max_kld": -0.917}, None, "quality.max_kld"),
        ({"max_kld": 10.917}, None, "quality.max_kld"),
        ({"max_kld": math.nan}, None, "quality.max_kld"),
        ({"max_kld": math.inf}, None, "quality.max_kld"),
        ({"min_top1": 1.917}, None, "quality.min_top1"),
        ({"min_top1": -0.917}, None, "quality.min_top1"),
        # integers past every float: float() would raise OverflowError (was a 500)
        ({"max_kld": 10**400}, None, "quality.max_kld"),
        ({"max_kld": -(10**400)}, None, "quality.max_kld"),
        ({"min_top1": 10**400}, None, "quality.min_top1"),
        ({"max_kld": 0.01, "min_top1": 10**400}, None, "quality.min_top1"),
        (None, "max_kld=" + "9" * 400, QUALITY_HEADER),
        (None, "max_kld=²", QUALITY_HEADER),
        (None, "max_kld=٣", QUALITY_HEADER),
        (None, f"ultra-{SECRET}", QUALITY_HEADER),
        (None, "", QUALITY_HEADER),
        (None, "max_kld=", QUALITY_HEADER),
        (None, f"max_kld={SECRET}", QUALITY_HEADER),
        (None, "max_kld=nan", QUALITY_HEADER),
        (None, "max_kld=inf", QUALITY_HEADER),
        (None, "max_kld=-0.917", QUALITY_HEADER),
        (None, "max_kld=0x10", QUALITY_HEADER),
        (None, "max_kld=1_0", QUALITY_HEADER),
        (None, "max_kld=10.917", QUALITY_HEADER),
        (None, "max_kld=1e999", QUALITY_HEADER),
        (None, "min_top1=1.917", QUALITY_HEADER),
        (None, "max_kld=0.1,max_kld=0.2", QUALITY_HEADER),
        (None, f"{SECRET}=0.1", QUALITY_HEADER),
        (None, "max_kld=0.1;min_top1=0.9", QUALITY_HEADER),
        (None, "max_kld=0.1,", QUALITY_HEADER),
        (None, "high,max_kld=0.1", QUALITY_HEADER),
        # both given, disagreeing: a 400, not a silent preference for one
        ("high", "balanced", "quality"),
        ("exact", "max_kld=0", "quality"),
        ({"max_kld": 0.01}, "max_kld=0.02", "quality"),
        ({"max_kld": 0.01}, "max_kld=0.01,min_top1=0.9", "quality"),
    ],
)
def test_bad_quality_is_400_naming_the_param_and_not_echoing(
    body: object, header: str | None, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse(body, header)
    err = info.value
    assert err.status == 400 and err.param == param
    for echoed in (SECRET, "917", "0x10", "1_0", "1e999"):
        assert echoed not in err.message


# ---- deadline ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "timeout", "expected"),
    [
        (None, None, None),
        ("250", None, 250.0),
        (" 1 ", None, 1.0),
        ("1.5", None, 1.5),
        ("3600000", None, 3_600_000.0),
        (None, 1.5, 1500.0),
        (None, 3600, 3_600_000.0),
        (None, 0.001, 1.0),
        ("250", 10, 250.0),  # both: the earlier deadline counts
        ("20000", 1, 1000.0),
    ],
)
def test_deadline(header: str | None, timeout: object, expected: float | None) -> None:
    assert parse(deadline=header, timeout=timeout).deadline_ms == expected


@pytest.mark.parametrize(
    ("header", "timeout", "param"),
    [
        ("0", None, DEADLINE_HEADER),
        ("0.5", None, DEADLINE_HEADER),
        ("3600000.5", None, DEADLINE_HEADER),
        ("-917", None, DEADLINE_HEADER),
        ("", None, DEADLINE_HEADER),
        (SECRET, None, DEADLINE_HEADER),
        ("nan", None, DEADLINE_HEADER),
        ("inf", None, DEADLINE_HEADER),
        ("1e999", None, DEADLINE_HEADER),
        ("1_000", None, DEADLINE_HEADER),
        (None, 0, "timeout"),
        (None, -1, "timeout"),
        (None, 3600.917, "timeout"),
        (None, True, "timeout"),
        (None, "30", "timeout"),
        (None, math.nan, "timeout"),
        (None, math.inf, "timeout"),
        (None, [1], "timeout"),
        (None, 10**400, "timeout"),
        (None, -(10**400), "timeout"),
        (None, 2**64, "timeout"),
        ("9" * 500, None, DEADLINE_HEADER),
        ("٣", None, DEADLINE_HEADER),
    ],
)
def test_bad_deadline_is_400(header: str | None, timeout: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse(deadline=header, timeout=timeout)
    assert info.value.param == param
    for echoed in (SECRET, "917", "1e999", "1_000"):
        assert echoed not in info.value.message


# ---- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"tight_free_bytes": 9 << 30},  # above ample
        {"default_tier": "ultra"},
        {"constrained_cost_ratio": 0},
        {"fit_decay": 1.5},
        {"top_k": 0},
        {"weights": {"load": -1}},
        {"tiers": {"exact": {"max_kld": 0, "on_infeasible": "wait", "wait_s": 0}}},
        {"tiers": {"high": {"max_kld": 0.001, "on_infeasible": "best_effort"}}},
        {"tiers": {"high": {"max_kld": 11}}},
        {"tiers": {"ultra": {}}},
        {"unknown": 1},
    ],
)
def test_bad_settings_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RoutingSettings.model_validate(overrides)


def test_settings_defaults_frozen_and_described() -> None:
    s = RoutingSettings()
    assert (s.ample_free_bytes, s.tight_free_bytes) == (8 << 30, 4 << 30)
    assert (s.default_tier, s.constrained_cost_ratio, s.top_k) == (Tier.BALANCED, 0.6, 2)
    assert s.tiers.exact == TierSettings(max_kld=0.0, on_infeasible="wait", wait_s=5.0)
    assert s.tiers.fast.on_infeasible == "best_effort" and not s.tiers.fast.bounded
    with pytest.raises(ValidationError):
        s.top_k = 3

    def fields(model: type[Any]) -> list[Any]:
        out = []
        for info in model.model_fields.values():
            out.append(info)
            annotation = info.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                out += fields(annotation)
        return out

    assert all(info.description for info in fields(RoutingSettings))


@pytest.mark.parametrize(
    "name", ["requirement", "settings", "affinity", "score", "policy", "states", "table"]
)
def test_doctests(name: str) -> None:
    module = importlib.import_module(f"quantroute.routing.{name}")
    failures, _ = doctest.testmod(module, verbose=False)
    assert failures == 0


def test_a_partial_tier_override_keeps_the_tiers_other_defaults() -> None:
    s = RoutingSettings.model_validate({"tiers": {"high": {"max_kld": 0.005}}})
    assert (s.tiers.high.max_kld, s.tiers.high.min_top1) == (0.005, 0.98)
    assert s.tiers.exact == RoutingSettings().tiers.exact
    cleared = RoutingSettings.model_validate({"tiers": {"balanced": {"min_top1": None}}})
    assert (cleared.tiers.balanced.max_kld, cleared.tiers.balanced.min_top1) == (0.02, None)
    exact = RoutingSettings.model_validate({"tiers": {"exact": {"wait_s": 1.5}}}).tiers.exact
    assert (exact.max_kld, exact.on_infeasible, exact.wait_s) == (0.0, "wait", 1.5)


# ---- totality: anything parses or is a 400 ---------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2**64, 5e-324, 1e-320]),
    st.floats(),
    st.text(),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.one_of(st.sampled_from(["max_kld", "min_top1"]), st.text()), inner)
    ),
    max_leaves=6,
)
HEADER_VALUES = st.one_of(
    st.none(),
    st.text(st.characters(max_codepoint=0xFF), max_size=30),  # headers arrive as latin-1
    st.sampled_from(["max_kld=1e-3", "min_top1=1", "250", "fast", "max_kld=" + "9" * 400]),
)


@settings(max_examples=300, deadline=None)
@given(body=JSON_VALUES, header=HEADER_VALUES, deadline=HEADER_VALUES, timeout=JSON_VALUES)
def test_any_input_is_a_requirement_or_a_400_naming_its_field(
    body: object, header: str | None, deadline: str | None, timeout: object
) -> None:
    try:
        r = parse(body, header, deadline, timeout)
    except InvalidRequestError as exc:
        assert exc.status == 400
        assert exc.param in {"quality", "quality.max_kld", "quality.min_top1", "timeout"} | {
            QUALITY_HEADER,
            DEADLINE_HEADER,
        }
        return
    for bound in (r.max_kld, r.min_top1, r.deadline_ms):
        assert bound is None or math.isfinite(bound)
    assert r.max_kld is None or 0.0 <= r.max_kld <= 10.0
    assert r.min_top1 is None or 0.0 <= r.min_top1 <= 1.0
    assert r.deadline_ms is None or 1.0 <= r.deadline_ms <= 3_600_000.0

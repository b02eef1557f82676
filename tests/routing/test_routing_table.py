"""Model references: ``model`` or ``model:branch``; unknown ones are 404s, never a default;
a pinned branch answers alone, or 503s while it does not take traffic."""

from __future__ import annotations

import pytest

from qrtest import fake_table
from quantroute.errors import NotFoundError, ServiceUnavailableError
from quantroute.routing import lookup, parse_model_ref, pinned


@pytest.mark.parametrize(
    ("ref", "expected"),
    [("m", ("m", None)), ("m:b", ("m", "b")), ("m:", ("m", "")), ("a:b:c", ("a", "b:c"))],
)
def test_parse_model_ref(ref: str, expected: tuple[str, str | None]) -> None:
    assert parse_model_ref(ref) == expected


def test_lookup_finds_the_model_and_its_pinned_branch() -> None:
    table = fake_table()
    route, branch = lookup(table, "tiny-llama")
    assert route.name == "tiny-llama" and branch is None
    route, branch = lookup(table, "tiny-llama:q4_k_m")
    assert branch is not None and branch.id == "tiny-llama:q4_k_m"


@pytest.mark.parametrize("ref", ["llama-7b", "tiny-llama:q2_k", "tiny-llama:"])
def test_unknown_model_or_branch_is_404_never_a_default(ref: str) -> None:
    with pytest.raises(NotFoundError) as info:
        lookup(fake_table(), ref)
    assert info.value.param == "model" and "tiny-llama" in info.value.message


def test_a_pinned_branch_answers_alone_or_503s() -> None:
    decision = pinned("m", "m:q8_0", ready=True, retry_after_s=2.0)
    assert decision.branch_ids == ("m:q8_0",) and decision.pinned and decision.reason == "pinned"
    with pytest.raises(ServiceUnavailableError) as info:
        pinned("m", "m:q8_0", ready=False, retry_after_s=2.0)
    assert info.value.retry_after_s == 2.0


def test_by_id_keeps_the_decision_order() -> None:
    route, _ = lookup(fake_table(), "tiny-llama")
    ids = ("tiny-llama:q4_k_m", "tiny-llama:f16")
    assert [b.id for b in route.by_id(ids)] == list(ids)

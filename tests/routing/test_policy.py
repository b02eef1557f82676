from __future__ import annotations

import pytest

from qrtest import fake_table
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.errors import NotFoundError, ServiceUnavailableError
from quantroute.routing import RouteTable, choose, parse_model_ref


async def _started(**faults: bool) -> RouteTable:
    engines = {
        n: FakeEngine(faults=FakeFaults(unavailable=faults.get(n, False)))
        for n in ("q4_k_m", "f16", "q8_0")
    }
    for e in engines.values():
        await e.start()
    return fake_table(dict(engines))


@pytest.mark.parametrize(
    ("ref", "expected"),
    [("m", ("m", None)), ("m:b", ("m", "b")), ("m:", ("m", "")), ("a:b:c", ("a", "b:c"))],
)
def test_parse_model_ref(ref: str, expected: tuple[str, str | None]) -> None:
    assert parse_model_ref(ref) == expected


async def test_highest_precision_ready_branch_first_then_fallbacks() -> None:
    decision = choose(await _started(), "tiny-llama")
    assert [b.name for b in decision.branches] == ["f16", "q8_0", "q4_k_m"]
    assert not decision.pinned


async def test_unready_branches_are_skipped() -> None:
    decision = choose(await _started(f16=True), "tiny-llama")
    assert [b.name for b in decision.branches] == ["q8_0", "q4_k_m"]


async def test_pinned_branch_answers_alone() -> None:
    decision = choose(await _started(), "tiny-llama:q4_k_m")
    assert [b.name for b in decision.branches] == ["q4_k_m"] and decision.pinned


async def test_unknown_model_or_branch_is_404_never_a_default() -> None:
    table = await _started()
    for ref in ("llama-7b", "tiny-llama:q2_k", "tiny-llama:"):
        with pytest.raises(NotFoundError):
            choose(table, ref)


async def test_nothing_ready_is_503_with_retry_after() -> None:
    with pytest.raises(ServiceUnavailableError) as info:
        choose(await _started(f16=True, q8_0=True, q4_k_m=True), "tiny-llama")
    assert info.value.retry_after_s
    with pytest.raises(ServiceUnavailableError):
        choose(await _started(q8_0=True), "tiny-llama:q8_0")


async def test_degraded_branches_become_the_last_fallbacks() -> None:
    table = await _started()
    decision = choose(table, "tiny-llama", degraded=lambda b: b == "tiny-llama:f16")
    assert [b.name for b in decision.branches] == ["q8_0", "q4_k_m", "f16"]
    assert decision.reason == "highest-precision-ready"
    everything = choose(table, "tiny-llama", degraded=lambda b: True)
    assert everything.reason == "degraded-branch-only"
    assert [b.name for b in everything.branches] == ["f16", "q8_0", "q4_k_m"]
    pinned = choose(table, "tiny-llama:f16", degraded=lambda b: True)
    assert pinned.branches[0].name == "f16"  # a pin is honoured: the client asked for it

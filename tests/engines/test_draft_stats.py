"""What drafting gave a reference (``engines/llamacpp/draft.py``): the figures of its
drafted requests folded into :class:`SpeculationStats`, and the speed-up routing reads,
in steps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantroute.engines.llamacpp.draft import SpeculationStats, routed_speedup


def test_stats_count_every_request_and_weigh_the_recent_ones() -> None:
    stats = SpeculationStats().add(40, 36, 4.0, 1.25)
    assert (stats.requests, stats.drafted, stats.accepted) == (1, 40, 36)
    assert stats.acceptance == pytest.approx(0.9) and stats.mean_k == 4.0  # the first: whole
    stats = stats.add(20, 10, 2.0, 0.0)  # a request whose worker had not measured: speed kept
    assert (stats.requests, stats.drafted, stats.accepted) == (2, 60, 46)
    assert stats.acceptance == pytest.approx(0.8 * 0.9 + 0.2 * 0.5)
    assert stats.mean_k == pytest.approx(0.8 * 4.0 + 0.2 * 2.0)
    assert stats.speedup == 1.25
    assert stats.to_dict() == {
        "requests": 2,
        "drafted_tokens": 60,
        "accepted_tokens": 46,
        "acceptance_rate": 0.82,
        "mean_k": 3.6,
        "speedup": 1.25,
    }
    assert SpeculationStats().to_dict()["speedup"] is None  # not measured


def test_routing_reads_the_speedup_in_steps() -> None:
    assert routed_speedup(0.0) == 1.0  # not measured: plain decoding's speed
    assert routed_speedup(1.0) == 1.0
    assert routed_speedup(100.0) == pytest.approx(16.0)  # capped
    assert routed_speedup(1.19) == routed_speedup(1.2)  # within a step: the same value


@given(st.floats(0.01, 16.0))
def test_a_routed_speedup_is_within_half_a_step_of_the_measured(speedup: float) -> None:
    routed = routed_speedup(speedup)
    assert abs(routed / speedup - 1) <= 2 ** (1 / 32) - 1 + 1e-9
    assert routed_speedup(routed) == pytest.approx(routed)  # a step is its own step

"""The deadline left after the admission queue is what routing plans with."""

from __future__ import annotations

from quantroute.api.service import _after_queue
from quantroute.routing.requirement import parse_requirement
from quantroute.routing.settings import RoutingSettings


def test_routing_plans_with_the_deadline_the_admission_queue_left() -> None:
    s = RoutingSettings()
    req = parse_requirement("fast", None, "1000", None, s)
    assert _after_queue(req, 0.0) is req  # no wait: the very requirement (a cached ranking)
    assert _after_queue(req, 0.8).deadline_ms == 200.0
    assert _after_queue(req, 0.0123).deadline_ms == 985.0  # rounded down to 5 ms
    assert _after_queue(req, 2.0).deadline_ms == 0.0
    none = parse_requirement("fast", None, None, None, s)
    assert _after_queue(none, 0.5) is none
    assert _after_queue(req, 0.0123).tier == req.tier

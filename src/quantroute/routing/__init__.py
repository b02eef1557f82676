"""Routing: the route table and the choice of branch for each request."""

from __future__ import annotations

from quantroute.routing.policy import Decision, choose, parse_model_ref
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef

__all__ = [
    "Branch",
    "Decision",
    "ModelRoute",
    "RouteTable",
    "RouteTableRef",
    "choose",
    "parse_model_ref",
]

"""Routing: the route table, the per-request choice of branch, and residency.

Modules, leaf first: ``records`` (what the policy reads), ``requirement``
(what a request asks), ``filters`` and ``score`` (the policy's two steps),
``policy`` (the choice and its explanation), ``table`` (models → branches,
model lookup), ``states`` (building the records from live state),
``residency`` (which branches are loaded), ``versions`` (a model's versions
and the traffic rules that pick one per request).
"""

from __future__ import annotations

from quantroute.routing.policy import Decision, Explanation, choose, explain, pinned
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import Requirement, parse_requirement
from quantroute.routing.residency import Residency, ResidencyPlan, ResidentBranch, plan_residency
from quantroute.routing.states import BranchStates, RecentRate
from quantroute.routing.table import (
    Branch,
    ModelRoute,
    RouteTable,
    RouteTableRef,
    lookup,
    parse_model_ref,
)
from quantroute.routing.versions import Audience, Rule, VersionSplit, user_bucket

__all__ = [
    "Audience",
    "Branch",
    "BranchState",
    "BranchStates",
    "Decision",
    "Explanation",
    "ModelRoute",
    "RecentRate",
    "RequestShape",
    "Requirement",
    "Residency",
    "ResidencyPlan",
    "ResidentBranch",
    "RouteTable",
    "RouteTableRef",
    "Rule",
    "VersionSplit",
    "choose",
    "explain",
    "lookup",
    "parse_model_ref",
    "parse_requirement",
    "pinned",
    "plan_residency",
    "user_bucket",
]

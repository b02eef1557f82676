"""Routing: the route table, the per-request choice of branch, and residency."""

from __future__ import annotations

from quantroute.routing.policy import Decision, choose, parse_model_ref
from quantroute.routing.requirement import Requirement, parse_requirement
from quantroute.routing.residency import ResidencyPlan, ResidentBranch, plan_residency
from quantroute.routing.scoring import (
    BranchState,
    Explanation,
    RequestShape,
    RouteDecision,
    choose_branch,
    explain,
)
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef

__all__ = [
    "Branch",
    "BranchState",
    "Decision",
    "Explanation",
    "ModelRoute",
    "RequestShape",
    "Requirement",
    "ResidencyPlan",
    "ResidentBranch",
    "RouteDecision",
    "RouteTable",
    "RouteTableRef",
    "choose",
    "choose_branch",
    "explain",
    "parse_model_ref",
    "parse_requirement",
    "plan_residency",
]

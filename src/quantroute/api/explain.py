"""The body of ``POST /v1/route/explain``: the routing decision for a request, without
running it, with each branch's filters and score (``Service.explain`` reads the request
and the branches' states; this renders what the policy makes of them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quantroute.config import RoutingSettings
from quantroute.errors import QuantrouteError
from quantroute.routing.policy import Explanation, choose, explain
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import Requirement
from quantroute.routing.table import Branch

_REQUIREMENT = ("tier", "max_kld", "min_top1", "deadline_ms", "explicit")


def pinned_json(model: str, branch: Branch, *, ready: bool) -> dict[str, Any]:
    """A pinned branch (``model:branch``): it answers alone, while it takes traffic."""
    return {
        "model": model,
        "decision": {
            "branches": [branch.id] if ready else [],
            "reason": "pinned" if ready else "pinned:not-ready",
            "wait_s": None,
        },
        "branches": [],
    }


def explain_json(
    model: str,
    requirement: Requirement,
    shape: RequestShape,
    states: Sequence[BranchState],
    settings: RoutingSettings,
    engines: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The policy's decision for ``model``'s ``states``, and per branch each filter and
    the score; an infeasible request's error in place of the decision. ``engines``: each
    branch id's engine (its manifest's ``engine:``), shown beside it."""
    body: dict[str, Any] = {"model": model}
    body["requirement"] = {f: getattr(requirement, f) for f in _REQUIREMENT}
    body["request"] = {"prompt_tokens_max": shape.prompt_tokens, "max_tokens": shape.max_tokens}
    explained: tuple[Explanation, ...] = ()  # the decision's own: with each place in it
    try:
        decision = choose(model, requirement, shape, states, settings)
        body["decision"] = {
            "branches": list(decision.branch_ids),
            "reason": decision.reason,
            "wait_s": decision.wait_s,
        }
        explained = decision.explanations
    except QuantrouteError as exc:
        body["decision"] = {
            "branches": [],
            "reason": "infeasible",
            "error": exc.to_openai()["error"],
        }
    if not explained:  # nothing chosen (a wait, a 503): the filters and scores alone
        explained = explain(requirement, shape, states, settings)
    body["branches"] = [e.to_dict() for e in explained]
    if engines is not None:
        for row in body["branches"]:
            row["engine"] = engines.get(row["branch"])
    return body

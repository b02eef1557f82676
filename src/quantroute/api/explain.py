"""The body of ``POST /v1/route/explain``: the routing decision for a request, without
running it, with each branch's filters and score (``Service.explain`` reads the request
and the branches' states; this renders what the policy makes of them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quantroute.config import RoutingSettings
from quantroute.engines.llamacpp.engine import LlamaCppEngine
from quantroute.errors import QuantrouteError
from quantroute.routing.policy import Explanation, choose, explain
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import Requirement
from quantroute.routing.table import Branch

_REQUIREMENT = ("tier", "max_kld", "min_top1", "deadline_ms", "explicit")


def speculation_json(branches: Sequence[Branch], settings: RoutingSettings) -> dict[str, Any]:
    """How ``branches`` (a route's, or a pinned one) speculate: the setting, the draft the
    reference's worker loaded (its branch id; ``None``: none loaded, or ``off``), the
    branches a request would be drafted on (``drafted``), what drafting gave each of them
    so far (``measured``: ``SpeculationStats``, with the speed-up routing credits it with,
    ``routed_speedup``), and why a branch given a draft holds none (``problems``)."""
    drafts = {b.id: b.draft for b in branches if b.draft is not None}
    measured: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for b in branches:
        engine, info = b.engine, b.engine.info
        if not isinstance(engine, LlamaCppEngine):
            continue
        if b.id in drafts and info is not None:
            measured[b.id] = {**engine.speculation.to_dict(), "routed_speedup": info.speedup}
        if engine.draft_problem is not None:
            problems[b.id] = engine.draft_problem
    return {
        "mode": settings.speculation,
        "k_max": settings.speculation_k_max,
        "draft": next(iter(drafts.values()), None),
        "drafted": sorted(drafts),
        "measured": measured,
        "problems": problems,
    }


def pinned_json(
    model: str, branch: Branch, *, ready: bool, settings: RoutingSettings | None = None
) -> dict[str, Any]:
    """A pinned branch (``model:branch``): it answers alone, while it takes traffic; with
    ``settings``, how it speculates (:func:`speculation_json`)."""
    body = {
        "model": model,
        "decision": {
            "branches": [branch.id] if ready else [],
            "reason": "pinned" if ready else "pinned:not-ready",
            "wait_s": None,
        },
        "branches": [],
    }
    if settings is not None:
        body["speculation"] = speculation_json([branch], settings)
    return body


def explain_json(
    model: str,
    requirement: Requirement,
    shape: RequestShape,
    states: Sequence[BranchState],
    settings: RoutingSettings,
    branches: Sequence[Branch] = (),
) -> dict[str, Any]:
    """The policy's decision for ``model``'s ``states``, and per branch each filter and
    the score; an infeasible request's error in place of the decision. ``branches``: the
    route's, whose engines (their manifests' ``engine:``) and drafts are shown beside
    them, and how the route speculates (``speculation``: :func:`speculation_json`)."""
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
    if branches:
        by_id = {b.id: b for b in branches}
        for row in body["branches"]:
            b = by_id.get(row["branch"])
            row["engine"] = b.artifact.engine if b is not None else None
            row["draft"] = b.draft if b is not None else None
        body["speculation"] = speculation_json(branches, settings)
    return body

"""The routing policy: for one request, the branch to try first, its fallbacks, and why.

:func:`choose` is pure: immutable records in (:class:`Requirement`,
:class:`RequestShape`, a sequence of :class:`BranchState`, the settings), an
immutable :class:`Decision` out; no I/O, no clock, no locks, no asyncio.
The caller reads the current route table and device snapshot once per
request; both are replaced whole and swapped by reference (``RouteTableRef``,
the poller's snapshot), never edited, so a decision never sees half an update
and readers never lock.

The steps:

1. **Filters** (:mod:`~quantroute.routing.filters`): ready, breaker,
   quality, memory, deadline. A branch that fails one is out; nothing overrides that.
2. **Score** (:mod:`~quantroute.routing.score`): memory-regime fit, headroom,
   load, deadline slack, health, heat, weighted.
3. **Affinity** (:mod:`~quantroute.routing.affinity`): among the ``top_k``
   best whose scores are within ``tie_epsilon`` of the best, rendezvous
   hashing of the prompt prefix picks the primary, so a repeated prefix lands
   where its prompt cache is.
4. **Fallbacks**: every other feasible branch, by score. Never a branch that
   fails the quality bound.

Steps 1, 2 and the order come from :mod:`~quantroute.routing.ranking`, which keeps
the ranking per requirement and request size and updates it incrementally as
records change (equal to a fresh computation; see there).

With a deadline and ``routing.speeds.margin_deviations`` set (off by default),
branches that meet it with a margin (their observed speed plus that many
deviations, :mod:`~quantroute.routing.speeds`) rank before those in time only on
average, which follow as fallbacks; affinity breaks ties only among the former.

When nothing is feasible only because every branch that would serve is predicted
late, and some are late only on average (their observed prediction, less
``routing.speeds.reach_deviations`` deviations, meets the deadline, and so does
the profile's engine-only time), those are
tried, fastest predicted first, with reason ``deadline:within-reach``: the
prediction is a mean, a request the gateway cuts at its deadline costs at most
that long, and a 503 is a certain miss (a best-effort tier's other branches follow as
fallbacks). Otherwise, when nothing is feasible, the tier decides
(``TierSettings.on_infeasible``):

==============================  ==================================================================
requirement                     outcome
==============================  ==================================================================
no branch ready (any tier)      :class:`ServiceUnavailableError` with ``retry_after_s``
``exact`` (wait)                a decision with no branches and ``wait_s``: the caller waits up to
                                that long for the reference, routes again, then answers 503 with
                                Retry-After. ``wait_s`` is cut to what the deadline leaves after
                                the reference's own service time; if waiting cannot help (no
                                reference, the request can never fit its device, or the deadline
                                is too short even for an idle reference) it is a 503 at once
``high``, ``balanced``,         :class:`ServiceUnavailableError` with ``retry_after_s``: never a
explicit bounds (reject)        silent downgrade below the bound
``fast`` (best effort)          the cheapest ready branch whose breaker is not open, ignoring
                                memory and deadline, the others as fallbacks by cost; reason
                                ``best-effort``
==============================  ==================================================================

The decision's ``reason`` (header-safe): ``best-fit:<regime>`` (the primary
has the best memory-regime fit; regime of its device), ``shifted:<term>`` (a
branch with a better fit lost; ``term`` is what gained most, e.g. ``load``),
``only-feasible``, ``near-tie`` (affinity preferred a branch with a slightly
lower fit), ``shifted:margin`` (a better-scored branch meets the deadline only
on average), each with ``+affinity`` when prefix affinity broke a near tie;
``best-effort``; ``deadline:within-reach``; ``wait:reference``; ``pinned``
(:func:`pinned`: the client named the branch, and no policy ran). Per-branch
:class:`Explanation`\\ s are built from the decision's numbers only when read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from quantroute.errors import ServiceUnavailableError
from quantroute.routing import filters
from quantroute.routing.filters import BREAKER, DEADLINE, MEMORY, QUALITY, READY
from quantroute.routing.ranking import rank
from quantroute.routing.records import BranchState, RequestShape, Row
from quantroute.routing.requirement import Requirement
from quantroute.routing.score import (
    BITS,
    TERMS,
    Regime,
    fidelity_key,
    reference_bits,
    regime,
    score_branches,
    weights,
)
from quantroute.routing.settings import RoutingSettings

__all__ = [
    "Decision",
    "Explanation",
    "FilterCheck",
    "ScoreTerm",
    "choose",
    "explain",
    "pinned",
]


@dataclass(frozen=True, slots=True)
class FilterCheck:
    """One hard filter's verdict on one branch, e.g. ``memory, False, "needs ... > ... free"``."""

    name: str
    passed: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ScoreTerm:
    """One score term: its value in [0, 1] and its weight."""

    name: str
    value: float
    weight: float

    @property
    def contribution(self) -> float:
        """``weight * value``: what the term adds to the score."""
        return self.weight * self.value


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why one branch was or was not chosen.

    ``position`` is its place in the decision (0 = primary, then fallbacks;
    ``None`` = not chosen); ``score`` and ``terms`` exist only for feasible
    branches; ``regime`` is that of its device.
    """

    branch_id: str
    feasible: bool
    position: int | None
    regime: Regime
    need_bytes: int
    predicted_ms: float | None
    filters: tuple[FilterCheck, ...]
    score: float | None
    terms: tuple[ScoreTerm, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form, for logs and a debugging endpoint."""
        return {
            "branch": self.branch_id,
            "feasible": self.feasible,
            "position": self.position,
            "regime": self.regime.value,
            "need_bytes": self.need_bytes,
            "predicted_ms": self.predicted_ms,
            "filters": [
                {"name": f.name, "passed": f.passed, "reason": f.reason} for f in self.filters
            ],
            "score": self.score,
            "terms": [{"name": t.name, "value": t.value, "weight": t.weight} for t in self.terms],
        }


class _Trace:
    """The numbers behind a decision, kept so explanations can be built on demand."""

    __slots__ = (
        "branches",
        "chosen",
        "feasible",
        "request",
        "requirement",
        "rows",
        "scored",
        "settings",
    )

    def __init__(
        self,
        requirement: Requirement,
        request: RequestShape,
        branches: Sequence[BranchState],
        rows: Sequence[Row],
        feasible: Sequence[int],
        scored: Sequence[tuple[float, tuple[float, ...]]],
        chosen: Sequence[int],
        settings: RoutingSettings,
    ) -> None:
        self.requirement = requirement
        self.request = request
        self.branches = branches
        self.rows = rows
        self.feasible = feasible
        self.scored = scored
        self.chosen = chosen
        self.settings = settings

    def explanations(self) -> tuple[Explanation, ...]:
        scores = dict(zip(self.feasible, self.scored, strict=True))
        position = {i: n for n, i in enumerate(self.chosen)}
        term_weights = weights(self.settings)
        out: list[Explanation] = []
        for i, b in enumerate(self.branches):
            row = self.rows[i]
            described = filters.describe(self.requirement, b, row, self.request.drafted)
            checks = tuple(FilterCheck(*c) for c in described)
            s = scores.get(i)
            out.append(
                Explanation(
                    branch_id=b.id,
                    feasible=not row[0],
                    position=position.get(i),
                    regime=regime(b.device_free_bytes, self.settings),
                    need_bytes=row[1],
                    predicted_ms=row[3],
                    filters=checks,
                    score=None if s is None else s[0],
                    terms=() if s is None else tuple(map(ScoreTerm, TERMS, s[1], term_weights)),
                )
            )
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Decision:
    """The branches of ``model`` to try, in order (primary first), and why.

    ``branch_ids`` is empty only when ``wait_s`` is set: the ``exact`` tier's
    "wait up to ``wait_s`` for the reference, route again, then 503".
    ``pinned``: the client named the branch (:func:`pinned`), no policy ran.
    ``explanations`` are built when read, one per input branch, in input order.
    """

    model: str
    branch_ids: tuple[str, ...]
    reason: str
    wait_s: float | None = None
    pinned: bool = False
    _trace: _Trace | None = field(default=None, repr=False, compare=False)

    @property
    def primary(self) -> str | None:
        """The branch to try first (``None`` for a wait)."""
        return self.branch_ids[0] if self.branch_ids else None

    @property
    def explanations(self) -> tuple[Explanation, ...]:
        """Each input branch's filters, score and place in this decision."""
        return () if self._trace is None else self._trace.explanations()


def pinned(model: str, branch_id: str, *, ready: bool, retry_after_s: float) -> Decision:
    """The decision for a request that names its branch (``tiny-llama:q4_k_m``): that
    branch alone, or a 503 while it does not take traffic. No fallback: the client chose."""
    if not ready:
        raise ServiceUnavailableError(
            f"branch {branch_id} is not ready", retry_after_s=retry_after_s
        )
    return Decision(model, (branch_id,), "pinned", pinned=True)


def choose(
    model: str,
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    settings: RoutingSettings,
) -> Decision:
    """The primary branch and its fallbacks for one request.

    ``branches`` are the candidates: normally every branch of the requested
    model (replicas on several devices included), ready or not, so the
    explanation covers all of them. Ids must be unique. Raises
    :class:`ServiceUnavailableError` when nothing can serve and the tier says
    reject (see the module docstring).
    """
    ranked, rows = rank(requirement, request, branches, settings)
    if ranked is None:
        return _nothing_feasible(model, requirement, request, branches, rows, settings)
    chosen, ids, reason = ranked.decide(branches, request, settings)
    trace = _Trace(
        requirement, request, branches, rows, ranked.feasible, ranked.scored, chosen, settings
    )
    return Decision(model, ids, reason, None, False, trace)


def explain(
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    settings: RoutingSettings,
) -> tuple[Explanation, ...]:
    """Every branch's filters and score without choosing, e.g. to log why a request got a 503."""
    rows = filters.evaluate(requirement, request, branches)
    feasible = [i for i, row in enumerate(rows) if not row[0]]
    scored = score_branches(requirement, branches, rows, feasible, settings) if feasible else []
    return _Trace(
        requirement, request, branches, rows, feasible, scored, (), settings
    ).explanations()


def _nothing_feasible(
    model: str,
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    settings: RoutingSettings,
) -> Decision:
    usable = [i for i, row in enumerate(rows) if not row[0] & (READY | BREAKER)]
    if not usable:
        raise ServiceUnavailableError(
            "no branch of the model is ready to serve", retry_after_s=settings.retry_after_s
        )
    tier = requirement.tier
    action = "reject" if tier is None else settings.tiers.get(tier).on_infeasible
    best_effort: list[int] = []
    if action == "best_effort" and not requirement.bounded:
        ref_bits = reference_bits(branches)
        best_effort = sorted(
            usable,
            key=lambda i: (
                BITS[branches[i].precision] / ref_bits[branches[i].model],
                fidelity_key(branches[i]),
                branches[i].id,
            ),
        )

    reach = _within_reach(requirement, request, branches, rows, settings)
    if reach or best_effort:
        # the branches within reach first; a best-effort tier's others follow as fallbacks
        order = (*reach, *(i for i in best_effort if i not in reach))
        reason = "deadline:within-reach" if reach else "best-effort"
        trace = _Trace(requirement, request, branches, rows, (), (), order, settings)
        return Decision(model, tuple([branches[i].id for i in order]), reason, None, False, trace)

    if action == "wait" and tier is not None:
        wait_s = _reference_wait(requirement, branches, rows, settings.tiers.get(tier).wait_s)
        if wait_s is not None:
            trace = _Trace(requirement, request, branches, rows, (), (), (), settings)
            return Decision(model, (), "wait:reference", wait_s, False, trace)

    raise ServiceUnavailableError(_unavailable_message(rows), retry_after_s=settings.retry_after_s)


def _within_reach(
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    settings: RoutingSettings,
) -> tuple[int, ...]:
    """The branches that fail only the deadline, and only on average: their observed
    prediction, ``routing.speeds.reach_deviations`` deviations sooner, meets it, and so
    does the profile's engine-only time (the soonest it could ever be, whatever the
    spread). Fastest predicted first. Empty without a deadline, without observed speeds,
    or with the setting 0."""
    deadline = requirement.deadline_ms
    k = settings.speeds.reach_deviations
    if deadline is None or k <= 0.0:
        return ()
    prompt, generate = request.prompt_tokens, request.max_tokens
    reach: list[tuple[float, tuple[int, float, int], int]] = []
    for i, (b, row) in enumerate(zip(branches, rows, strict=True)):
        fails, _, _, predicted = row
        if fails != DEADLINE or predicted is None or b.observed_ttft_ms is None:
            continue
        soonest = predicted - k * filters.spread_ms(b, generate)
        if b.prefill_tps and b.decode_tps:
            decode = b.decode_tps * (b.decode_speedup if request.drafted else 1.0)
            soonest = max(soonest, 1000.0 * (prompt / b.prefill_tps + generate / decode))
        if soonest <= deadline:
            reach.append((predicted, fidelity_key(b), i))
    return tuple(i for _, _, i in sorted(reach))


def _reference_wait(
    requirement: Requirement,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    tier_wait_s: float,
) -> float | None:
    """How long waiting for a reference can help, or ``None`` if it cannot."""
    best: float | None = None
    deadline = requirement.deadline_ms
    for b, (fails, need, service, _) in zip(branches, rows, strict=True):
        if not b.is_reference or fails & QUALITY:
            continue
        if fails & MEMORY and need > b.device_total_bytes:
            continue  # the request would not fit even on an empty device
        wait_s = tier_wait_s
        if deadline is not None and service is not None:
            wait_s = min(wait_s, (deadline - service) / 1000.0)
        if wait_s > 0 and (best is None or wait_s > best):
            best = wait_s
    return best


def _unavailable_message(rows: Sequence[Row]) -> str:
    counts = [(sum(1 for row in rows if row[0] & bit), name) for bit, name in filters.NAMES]
    reasons = {
        "ready": "not ready",
        "breaker": "its circuit breaker is open",
        "quality": "below the quality bound",
        "memory": "no device memory for it",
        "deadline": "too slow for the deadline",
    }
    why = "; ".join(
        f"{count} {'branch' if count == 1 else 'branches'} {reasons.get(name, name)}"
        for count, name in counts
        if count
    )
    return (
        f"no branch of the model can serve this request now ({why}); "
        "retry later, or relax the quality or deadline"
    )

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

With a deadline and ``routing.speeds.margin_deviations`` set (off by default),
branches that meet it with a margin (their observed speed plus that many
deviations, :mod:`~quantroute.routing.speeds`) rank before those in time only on
average, which follow as fallbacks; affinity breaks ties only among the former.

When nothing is feasible, the tier decides (``TierSettings.on_infeasible``):

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
``best-effort``; ``wait:reference``; ``pinned`` (:func:`pinned`: the client named
the branch, and no policy ran). Per-branch :class:`Explanation`\\ s
are built from the decision's numbers only when read.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from quantroute.errors import ServiceUnavailableError
from quantroute.routing import affinity, filters
from quantroute.routing.filters import BREAKER, MEMORY, QUALITY, READY
from quantroute.routing.records import BranchState, RequestShape, Row
from quantroute.routing.requirement import Requirement
from quantroute.routing.score import (
    BITS,
    TERMS,
    Ladder,
    Regime,
    fidelity_key,
    fidelity_ladder,
    reference_bits,
    regime,
    score_branches,
    score_some,
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
            checks = tuple(FilterCheck(*c) for c in filters.describe(self.requirement, b, row))
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


# The last ranking per (requirement, prompt and output size). While the states are the
# same tuple (``BranchStates.read`` returns the same one while no record changed) and the
# settings the same object, it is reused whole: filters and scores are pure, so they would
# come out equal. When some records changed (a new tuple of the same branches, most records
# the same objects: a request moved one branch's load), only those are filtered and scored
# again (:func:`_update`). A list of states is never reused (it could be edited in place).
_RANKED_MAX = 256
_ranked: dict[tuple[Requirement, int, int], _Ranked] = {}


class _Ranked:
    """One ranking and what it was computed from."""

    __slots__ = (
        "branches",
        "decided",
        "feasible",
        "keys",
        "known",
        "ladder",
        "ranking",
        "rows",
        "safe",
        "scored",
        "settings",
        "slot",
        "tied",
    )

    def __init__(
        self,
        branches: Sequence[BranchState],
        settings: RoutingSettings,
        rows: list[Row],
        feasible: list[int],
        slot: list[int],
        ladder: Ladder,
        scored: list[tuple[float, tuple[float, ...]]],
        keys: list[tuple[float, str, int]] | None,
        ranking: tuple[int, ...],
        safe: int,
    ) -> None:
        self.branches = branches
        self.settings = settings
        self.rows = rows
        self.feasible = feasible
        self.slot = slot  # per branch: its place in ``feasible``, -1 when infeasible
        self.ladder = ladder
        self.scored = scored
        # the feasible branches' sort keys (-score, id, place in feasible), sorted; None
        # when a NaN score leaves them no order to keep
        self.keys = keys
        self.ranking = ranking
        self.safe = safe
        # what choose derives from the ranking alone, kept until it changes: the ids prefix
        # affinity picks among, and per affinity pick (-1: none) the decision's branches
        # (indexes, ids) and reason
        self.tied: tuple[str, ...] | None = None
        self.decided: dict[int, tuple[list[int], tuple[str, ...], str]] = {}
        # id(record) -> (the record, its row, its score or _INFEASIBLE, its place): records
        # seen while this ranking's ladder held, each at that place in the states
        self.known: dict[int, tuple[BranchState, Row, tuple[float, tuple[float, ...]], int]] = {}


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
    size = (requirement, request.prompt_tokens, request.max_tokens)
    memo = _ranked.get(size) if type(branches) is tuple else None
    if memo is not None and memo.settings is settings:
        if memo.branches is not branches:
            memo = _update(memo, requirement, request, branches, settings)
    else:
        memo = None
    if memo is None:
        rows = filters.evaluate(requirement, request, branches)
        feasible = [i for i, row in enumerate(rows) if not row[0]]
        if not feasible:
            return _nothing_feasible(model, requirement, request, branches, rows, settings)
        ladder = fidelity_ladder(branches, feasible)
        n = len(feasible)
        scored = score_some(requirement, branches, rows, feasible, range(n), ladder, settings)
        keys = sorted(
            [
                (-s[0], branches[i].id, j)
                for j, (i, s) in enumerate(zip(feasible, scored, strict=True))
            ]
        )
        slot = [-1] * len(branches)
        for j, i in enumerate(feasible):
            slot[i] = j
        ranking, safe = _order(requirement, request, branches, rows, feasible, keys, settings)
        nan = any(k[0] != k[0] for k in keys)  # sorted() then has no order to keep up
        memo = _Ranked(
            branches,
            settings,
            rows,
            feasible,
            slot,
            ladder,
            scored,
            None if nan else keys,
            ranking,
            safe,
        )
        known = memo.known
        for k, b in enumerate(branches):
            j = slot[k]
            known[id(b)] = (b, rows[k], _INFEASIBLE if j < 0 else scored[j], k)
        if type(branches) is tuple:
            if len(_ranked) >= _RANKED_MAX:
                _ranked.clear()
            _ranked[size] = memo
    rows, feasible, scored = memo.rows, memo.feasible, memo.scored
    ranking, safe = memo.ranking, memo.safe
    tied = memo.tied
    if tied is None:
        tied = memo.tied = _tied(branches, feasible, ranking, scored, safe, settings)
    win = -1  # no affinity
    if len(tied) > 1 and request.prefix:
        win = affinity.pick(affinity.prefix_key(request.prefix), tied)
    decided = memo.decided.get(win)
    if decided is None:
        decided = memo.decided[win] = _decided(branches, memo, win, settings)
    chosen, ids, reason = decided
    trace = _Trace(requirement, request, branches, rows, feasible, scored, chosen, settings)
    return Decision(model, ids, reason, None, False, trace)


def _tied(
    branches: Sequence[BranchState],
    feasible: Sequence[int],
    ranking: tuple[int, ...],
    scored: Sequence[tuple[float, tuple[float, ...]]],
    safe: int,
    settings: RoutingSettings,
) -> tuple[str, ...]:
    """Ids of the best and of those within ``tie_epsilon`` of it, in ranking order, among
    the ``top_k`` best that meet the deadline with a margin: where prefix affinity picks."""
    tied = 1
    if len(ranking) > 1:
        floor = scored[ranking[0]][0] - settings.tie_epsilon
        for j in ranking[1 : min(settings.top_k, safe)]:
            if scored[j][0] < floor:
                break
            tied += 1
    return tuple([branches[feasible[j]].id for j in ranking[:tied]])


def _decided(
    branches: Sequence[BranchState], memo: _Ranked, win: int, settings: RoutingSettings
) -> tuple[list[int], tuple[str, ...], str]:
    """The branches chosen (indexes, ids) and the reason, with the tied branch at place
    ``win`` first (-1: no affinity)."""
    order = list(memo.ranking)
    scored = memo.scored
    if win > 0:
        order.insert(0, order.pop(win))
    chosen = [memo.feasible[j] for j in order]
    reason = _reason(order, scored, branches[chosen[0]], settings)
    if memo.safe < len(order) and scored[order[0]][0] < max(s[0] for s in scored):
        reason = "shifted:margin"  # a better score is in time only on average
    if win >= 0:
        reason += "+affinity"
    return chosen, tuple([branches[i].id for i in chosen]), reason


def _update(
    memo: _Ranked,
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    settings: RoutingSettings,
) -> _Ranked | None:
    """``memo`` brought up to ``branches``, in place, by filtering and scoring again only
    the records that are not the very objects it was computed from (or taking the row and
    score of a record it saw before: ``BranchStates`` hands back a branch's record when its
    load returns to an earlier value); ``None`` when that would not give what a fresh
    computation gives: other branches, or a changed record that changes the feasible set
    or the fidelity ladder (its model, precision, reference flag, mean KLD)."""
    old = memo.branches
    keys = memo.keys
    if len(old) != len(branches) or keys is None:
        return None
    changed = [k for k, b in enumerate(branches) if b is not old[k]]
    if not changed:  # the same records in a new tuple (a load went and came back)
        memo.branches = branches
        return memo
    if 2 * len(changed) > len(branches):
        return None  # most records moved: a fresh computation is as cheap
    slot = memo.slot
    known = memo.known
    rows = memo.rows.copy()  # copies: the last decision's explanation holds the old ones
    scored = memo.scored.copy()
    unscored = []
    for k in changed:
        b = branches[k]
        got = known.get(id(b))
        if got is not None and got[0] is b and got[3] == k:
            row, s = got[1], got[2]
        else:
            a = old[k]
            if (
                b.id != a.id
                or b.model != a.model
                or b.precision is not a.precision
                or b.is_reference != a.is_reference
                or b.mean_kld != a.mean_kld
            ):
                return None
            row, s = filters.evaluate(requirement, request, (b,))[0], None
        if (slot[k] < 0) != bool(row[0]):
            return None
        rows[k] = row
        j = slot[k]
        if j < 0:
            s = _INFEASIBLE
        elif s is None:
            unscored.append(j)
        elif not _rekey(keys, scored, j, s, b.id):
            return None
        if s is not None:
            known[id(b)] = (b, row, s, k)
    if unscored:
        feasible = memo.feasible
        again = score_some(requirement, branches, rows, feasible, unscored, memo.ladder, settings)
        for j, s in zip(unscored, again, strict=True):
            if s[0] != s[0]:
                return None  # NaN: see the fresh path
            k = feasible[j]
            b = branches[k]
            if not _rekey(keys, scored, j, s, b.id):
                return None
            known[id(b)] = (b, rows[k], s, k)
    if len(known) > _KNOWN_MAX:
        known.clear()
    memo.branches = branches
    memo.rows = rows
    memo.scored = scored
    memo.tied = None
    memo.decided = {}
    memo.ranking, memo.safe = _order(
        requirement, request, branches, rows, memo.feasible, keys, settings
    )
    return memo


_KNOWN_MAX = 64  # records whose row and score a ranking remembers
_INFEASIBLE = (math.nan, ())  # the known "score" of an infeasible record: none


def _rekey(
    keys: list[tuple[float, str, int]],
    scored: list[tuple[float, tuple[float, ...]]],
    j: int,
    s: tuple[float, tuple[float, ...]],
    branch_id: str,
) -> bool:
    """Feasible branch ``j`` now scores ``s``: its key moves in the sorted ``keys``. False
    (and the ranking is computed afresh) should its old key not be found: no guessing."""
    gone = (-scored[j][0], branch_id, j)
    at = bisect_left(keys, gone)
    if at == len(keys) or keys[at] != gone:
        return False
    del keys[at]
    insort(keys, (-s[0], branch_id, j))
    scored[j] = s
    return True


def _order(
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    feasible: Sequence[int],
    keys: list[tuple[float, str, int]],
    settings: RoutingSettings,
) -> tuple[tuple[int, ...], int]:
    """The ranking of scored feasible branches, from their sorted ``keys``: best score
    first, equal scores by id (so the input order never matters), then those meeting the
    deadline with a margin first; and how many those are."""
    if len(keys) == 1:
        return (0,), 1
    ranking = tuple([k[2] for k in keys])
    return _by_margin(requirement, request, branches, rows, feasible, ranking, settings)


def _by_margin(
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    feasible: Sequence[int],
    ranking: tuple[int, ...],
    settings: RoutingSettings,
) -> tuple[tuple[int, ...], int]:
    """``ranking`` with the branches that meet the deadline with a margin first, and how
    many those are (all of them without a deadline or a margin).

    The deadline filter predicts with the observed mean; a request whose deadline sits
    near it is a coin toss there. When some feasible branches still meet the deadline at
    ``routing.speeds.margin_deviations`` deviations above their observed speed, they go
    first, by score, and the ones in time only on average follow as fallbacks (never
    dropped: when none has the margin, the order is the score's)."""
    deadline = requirement.deadline_ms
    k = settings.speeds.margin_deviations
    if deadline is None or k <= 0.0:
        return ranking, len(ranking)
    later = max(0, request.max_tokens - 1)
    risky = set()
    for j in ranking:
        b = branches[feasible[j]]
        predicted = rows[feasible[j]][3]
        if b.observed_ttft_ms is None or predicted is None:
            continue
        spread = k * (b.observed_ttft_dev_ms + later * b.observed_tpot_dev_ms)
        if predicted + spread > deadline:
            risky.add(j)
    if not risky or len(risky) == len(ranking):
        return ranking, len(ranking)
    first = tuple(j for j in ranking if j not in risky)
    return first + tuple(j for j in ranking if j in risky), len(first)


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


def _reason(
    order: Sequence[int],
    scored: Sequence[tuple[float, tuple[float, ...]]],
    primary: BranchState,
    settings: RoutingSettings,
) -> str:
    if len(order) == 1:
        return "only-feasible"
    top = order[0]
    fits = [scored[j][1][0] for j in order]
    best_fit = order[fits.index(max(fits))]  # the first best in ``order``
    fit_gap = scored[best_fit][1][0] - scored[top][1][0]
    if fit_gap <= 1e-12:
        return f"best-fit:{regime(primary.device_free_bytes, settings).value}"
    term_weights = weights(settings)
    gains = [
        term_weights[t] * (scored[top][1][t] - scored[best_fit][1][t]) for t in range(1, len(TERMS))
    ]
    gain = max(gains)
    if gain <= 0.0:  # prefix affinity put a near-tied branch with a lower fit first
        return "near-tie"
    return f"shifted:{TERMS[1 + gains.index(gain)]}"


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

    if action == "best_effort" and not requirement.bounded:
        ref_bits = reference_bits(branches)
        order = sorted(
            usable,
            key=lambda i: (
                BITS[branches[i].precision] / ref_bits[branches[i].model],
                fidelity_key(branches[i]),
                branches[i].id,
            ),
        )
        trace = _Trace(requirement, request, branches, rows, (), (), order, settings)
        return Decision(
            model, tuple([branches[i].id for i in order]), "best-effort", None, False, trace
        )

    if action == "wait" and tier is not None:
        wait_s = _reference_wait(requirement, branches, rows, settings.tiers.get(tier).wait_s)
        if wait_s is not None:
            trace = _Trace(requirement, request, branches, rows, (), (), (), settings)
            return Decision(model, (), "wait:reference", wait_s, False, trace)

    raise ServiceUnavailableError(_unavailable_message(rows), retry_after_s=settings.retry_after_s)


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

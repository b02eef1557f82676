"""The policy's ranking of feasible branches, kept per requirement and request size and
brought up to date incrementally (:func:`rank`), and the decision's order and reason
from it (:meth:`Ranking.decide`).

A row depends only on its own record; a score on its record and row, the
requirement, the settings and the *fidelity ladder* (each feasible branch's
cost and level, each model's cheapest cost: :func:`~quantroute.routing.score.fidelity_ladder`).
So for a new states tuple of the same branches only the records that are not the
same objects as last time are filtered and scored again (or taken from what the
ranking remembers of them), and their keys moved in the sorted ranking. Anything
that could make that differ from a fresh computation (the feasible set or the
ladder changing, a NaN score, more than half the records new) computes afresh;
``tests/routing/test_routing_policy.py`` holds the two equal under churn.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

from quantroute.routing import affinity, filters
from quantroute.routing.records import BranchState, RequestShape, Row
from quantroute.routing.requirement import Requirement
from quantroute.routing.score import (
    TERMS,
    Ladder,
    fidelity_ladder,
    regime,
    score_some,
    weights,
)
from quantroute.routing.settings import RoutingSettings

__all__ = ["Ranking", "rank"]

# The last ranking per (requirement, prompt and output size). While the states are the
# same tuple (``BranchStates.read`` returns the same one while no record changed) and the
# settings the same object, it is reused whole: filters and scores are pure, so they would
# come out equal. When some records changed (a new tuple of the same branches, most records
# the same objects: a request moved one branch's load), only those are filtered and scored
# again (:func:`_update`). A list of states is never reused (it could be edited in place).
_RANKED_MAX = 256
_ranked: dict[tuple[Requirement, int, int], Ranking] = {}


class Ranking:
    """One ranking of the feasible branches and what it was computed from."""

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

    def decide(
        self, branches: Sequence[BranchState], request: RequestShape, settings: RoutingSettings
    ) -> tuple[list[int], tuple[str, ...], str]:
        """The decision's branches (indexes into ``branches``, ids) and reason: the ranking,
        with prefix affinity's pick among the near-tied best first."""
        tied = self.tied
        if tied is None:
            tied = self.tied = _tied(
                branches, self.feasible, self.ranking, self.scored, self.safe, settings
            )
        win = -1  # no affinity
        if len(tied) > 1 and request.prefix:
            win = affinity.pick(affinity.prefix_key(request.prefix), tied)
        decided = self.decided.get(win)
        if decided is None:
            decided = self.decided[win] = _decided(branches, self, win, settings)
        return decided


def rank(
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    settings: RoutingSettings,
) -> tuple[Ranking | None, list[Row]]:
    """The ranking of ``branches`` for this requirement and request size, and every
    branch's filter row; ``None`` for the ranking when no branch is feasible."""
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
            return None, rows
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
        memo = Ranking(
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
    return memo, memo.rows


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
    branches: Sequence[BranchState], memo: Ranking, win: int, settings: RoutingSettings
) -> tuple[list[int], tuple[str, ...], str]:
    """The branches chosen (indexes, ids) and the reason, with the tied branch at place
    ``win`` first (-1: no affinity)."""
    order = list(memo.ranking)
    scored = memo.scored
    if win > 0:
        order.insert(0, order.pop(win))
    chosen = [memo.feasible[j] for j in order]
    reason = _reason(order, scored, branches[chosen[0]], settings)
    # the ranking's own head (before affinity's pick among the tied): the margin moved it
    if memo.safe < len(order) and scored[memo.ranking[0]][0] < max(s[0] for s in scored):
        reason = "shifted:margin"  # a better score is in time only on average
    if win >= 0:
        reason += "+affinity"
    return chosen, tuple([branches[i].id for i in chosen]), reason


def _update(
    memo: Ranking,
    requirement: Requirement,
    request: RequestShape,
    branches: Sequence[BranchState],
    settings: RoutingSettings,
) -> Ranking | None:
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
    risky = set()
    for j in ranking:
        b = branches[feasible[j]]
        predicted = rows[feasible[j]][3]
        if b.observed_ttft_ms is None or predicted is None:
            continue
        if predicted + k * filters.spread_ms(b, request.max_tokens) > deadline:
            risky.add(j)
    if not risky or len(risky) == len(ranking):
        return ranking, len(ranking)
    first = tuple(j for j in ranking if j not in risky)
    return first + tuple(j for j in ranking if j in risky), len(first)


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

"""The score of a feasible branch: a weighted sum of terms, each in [0, 1], higher is better.

=========  =======  ===============================================================================
term       weight   value
=========  =======  ===============================================================================
fit        1.0      memory-regime fit: ``fit_decay ** level * price`` (below)
headroom   0.1      device memory left after admitting the request's KV cache, / device total
load       0.3      ``1 - min(1, occupancy / (parallel * load_saturation))``; occupancy is
                    running + queued sequences (each counted once), or ``recent_rate *
                    service time`` when that is more (Little's law: a burst that has not
                    shown up in the counters yet)
latency    0.1      ``1 - predicted / deadline``; 1 without a deadline, 0.5 with unknown speeds
health     0.2      the device's health factor
heat       0.05     ``1 - heat``, the device's thermal pressure (0 cool .. 1 throttling), from
                    its temperature (``routing.states.thermal_pressure``)
=========  =======  ===============================================================================

(``RoutingSettings.weights``; defaults shown.)

**Fit.** The feasible branches of a model are ranked by fidelity: the
reference first, then by profiled mean KLD, unprofiled ones last, precision
rank breaking ties; replicas of one precision share a level. ``level`` is a
branch's place in that order (0 = most faithful feasible). ``cost`` is its
bits per weight / the reference's. The *price* depends on the memory regime of
the branch's own device:

============  ==================================  =============================================
regime        free memory on the device           price
============  ==================================  =============================================
ample         ``>= ample_free_bytes`` (8 GiB)     1: the most faithful feasible branch fits best
constrained   ``tight .. ample`` (4 to 8 GiB)     1 if ``cost <= constrained_cost_ratio`` (0.6),
                                                  else ``constrained_cost_ratio / cost``
tight         ``< tight_free_bytes`` (4 GiB)      ``cheapest feasible cost / cost``
============  ==================================  =============================================

With the defaults and the demo's f16 / q8_0 / q4_k_m on one device (cost 1,
0.53, 0.31) the fits are 1 / 0.8 / 0.64 (ample), 0.6 / 0.8 / 0.64
(constrained), 0.31 / 0.46 / 0.64 (tight): the regime's choice leads by at
least 0.16, more than any small difference in the other terms, while a
saturated branch (load 0, a 0.3 loss) gives way to an idle one a level down.

A product rather than a per-regime ranking keeps devices comparable: an f16
on an ample device (fit 1) beats a q4_k_m on a tight one (0.64), where two
per-device rankings would both say "best fit" and tie.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from enum import StrEnum

from quantroute.routing.records import BranchState, Row
from quantroute.routing.requirement import Requirement
from quantroute.routing.settings import RoutingSettings
from quantroute.types import Precision

# The score terms, in the one order every tuple of term values and weights follows.
TERMS = ("fit", "headroom", "load", "latency", "health", "heat")

BITS: dict[Precision, float] = {p: p.spec.bits_per_weight for p in Precision}
RANK: dict[Precision, int] = {p: p.spec.rank for p in Precision}


class Regime(StrEnum):
    """How much free memory a device has, relative to the routing thresholds."""

    AMPLE = "ample"
    CONSTRAINED = "constrained"
    TIGHT = "tight"


def weights(settings: RoutingSettings) -> tuple[float, ...]:
    """The score's weights in the order of :data:`TERMS`."""
    return _constants(settings)[0]


# settings id -> (the settings, their weights, fit_decay ** level for levels 0..63): the
# settings are immutable, so this is read once per settings object, not per request
_CONSTANTS: dict[int, tuple[RoutingSettings, tuple[float, ...], tuple[float, ...]]] = {}


def _constants(settings: RoutingSettings) -> tuple[tuple[float, ...], tuple[float, ...]]:
    got = _CONSTANTS.get(id(settings))
    if got is None or got[0] is not settings:
        w = tuple(float(getattr(settings.weights, term)) for term in TERMS)
        decay = tuple(settings.fit_decay**level for level in range(64))
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        got = _CONSTANTS[id(settings)] = (settings, w, decay)
    return got[1], got[2]


def regime(free_bytes: int, settings: RoutingSettings) -> Regime:
    """The memory regime of a device with ``free_bytes`` free for routing."""
    if free_bytes >= settings.ample_free_bytes:
        return Regime.AMPLE
    if free_bytes >= settings.tight_free_bytes:
        return Regime.CONSTRAINED
    return Regime.TIGHT


def fidelity_key(b: BranchState) -> tuple[int, float, int]:
    """Sort key, most faithful first: reference, then profiled mean KLD, then precision rank."""
    return (
        0 if b.is_reference else 1,
        math.inf if b.mean_kld is None else b.mean_kld,
        RANK[b.precision],
    )


def reference_bits(branches: Sequence[BranchState]) -> dict[str, float]:
    """Bits per weight of each model's reference (its widest branch if none is marked)."""
    bits = {b.model: BITS[b.precision] for b in branches if b.is_reference}
    for b in branches:
        if b.model not in bits:  # rare: a model listed without its reference
            bits[b.model] = max(BITS[o.precision] for o in branches if o.model == b.model)
    return bits


def score_branches(
    requirement: Requirement,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    feasible: Sequence[int],
    settings: RoutingSettings,
) -> list[tuple[float, tuple[float, ...]]]:
    """``(score, terms)`` of each branch in ``feasible`` (indexes into ``branches``), in order.

    ``terms`` are the unweighted values in the order of :data:`TERMS`.
    """
    ladder = fidelity_ladder(branches, feasible)
    return score_some(requirement, branches, rows, feasible, range(len(feasible)), ladder, settings)


# Per feasible branch (in the order of ``feasible``) its cost (bits per weight / the
# reference's) and fidelity level, and each model's cheapest feasible cost: what a branch's
# fit depends on beyond its own record. It holds while the feasible set and each feasible
# branch's model, precision, reference flag and mean KLD do.
Ladder = tuple[list[float], list[int], dict[str, float]]


def fidelity_ladder(branches: Sequence[BranchState], feasible: Sequence[int]) -> Ladder:
    """The :data:`Ladder` of the feasible branches."""
    ref_bits = reference_bits(branches)
    inf = math.inf
    n = len(feasible)
    cost: list[float] = []
    keyed: list[tuple[tuple[int, float, int], int]] = []
    cheapest: dict[str, float] = {}
    for j, i in enumerate(feasible):
        b = branches[i]
        model = b.model
        c = BITS[b.precision] / ref_bits[model]
        kld = b.mean_kld
        # fidelity_key(b), inlined: this loop is the policy's hot path
        keyed.append(
            ((0 if b.is_reference else 1, inf if kld is None else kld, RANK[b.precision]), j)
        )
        cost.append(c)
        if c < cheapest.get(model, inf):
            cheapest[model] = c
    # level: place among the distinct fidelity keys of the model's feasible branches
    level: list[int] = [0] * n
    if len(cheapest) == 1:  # one model (the usual case): no per-model bookkeeping
        keyed.sort()
        seen_key, k = keyed[0][0], 0
        for key, j in keyed:
            if key != seen_key:
                seen_key, k = key, k + 1
            level[j] = k
    else:
        previous: dict[str, tuple[tuple[int, float, int], int]] = {}
        for key, j in sorted(keyed):
            model = branches[feasible[j]].model
            seen = previous.get(model)
            k = 0 if seen is None else (seen[1] if seen[0] == key else seen[1] + 1)
            previous[model] = (key, k)
            level[j] = k
    return cost, level, cheapest


def score_some(
    requirement: Requirement,
    branches: Sequence[BranchState],
    rows: Sequence[Row],
    feasible: Sequence[int],
    which: Iterable[int],
    ladder: Ladder,
    settings: RoutingSettings,
) -> list[tuple[float, tuple[float, ...]]]:
    """``(score, terms)`` of the feasible branches ``feasible[j]`` for ``j`` in ``which``, in
    that order: a branch's score depends only on its own record and row, the requirement,
    the settings and the ``ladder``, so one whose record changed can be scored alone."""
    cost, level, cheapest = ladder
    (w_fit, w_headroom, w_load, w_latency, w_health, w_heat), decays = _constants(settings)
    ratio = settings.constrained_cost_ratio
    ample = settings.ample_free_bytes
    tight = settings.tight_free_bytes
    saturation = settings.load_saturation
    deadline = requirement.deadline_ms
    no_deadline = deadline is None
    top = len(decays) - 1

    out: list[tuple[float, tuple[float, ...]]] = []
    append = out.append
    for j in which:
        i = feasible[j]
        b = branches[i]
        row = rows[i]
        free = b.device_free_bytes
        c = cost[j]
        if free >= ample:
            price = 1.0
        elif free >= tight:
            price = 1.0 if c <= ratio else ratio / c
        else:
            price = cheapest[b.model] / c
        lv = level[j]
        fit = (decays[lv] if lv <= top else decays[1] ** lv) * price

        total = b.device_total_bytes
        if total > 0:
            headroom = (free - row[1]) / total
            headroom = 0.0 if headroom < 0.0 else (1.0 if headroom > 1.0 else headroom)
        else:
            headroom = 0.0

        occupancy = float(b.running + b.queued)
        service = row[2]
        if b.recent_rate > 0.0 and service is not None:
            mean = b.mean_service_ms
            recent = b.recent_rate * (service if mean is None else mean) / 1000.0
            if recent > occupancy:
                occupancy = recent
        parallel = b.parallel if b.parallel > 0 else 1
        pressure = occupancy / (parallel * saturation)
        load = 0.0 if pressure >= 1.0 else 1.0 - pressure

        if no_deadline:
            latency = 1.0
        else:
            predicted = row[3]
            if predicted is None:
                latency = 0.5
            elif deadline > 0.0:  # type: ignore[operator]
                latency = 1.0 - predicted / deadline  # type: ignore[operator]
                if latency < 0.0:
                    latency = 0.0
            else:
                latency = 0.0

        health = b.device_health
        health = 0.0 if health < 0.0 else (1.0 if health > 1.0 else health)
        heat = b.heat
        cool = 1.0 - (0.0 if heat < 0.0 else (1.0 if heat > 1.0 else heat))

        append(
            (
                w_fit * fit
                + w_headroom * headroom
                + w_load * load
                + w_latency * latency
                + w_health * health
                + w_heat * cool,
                (fit, headroom, load, latency, health, cool),
            )
        )
    return out

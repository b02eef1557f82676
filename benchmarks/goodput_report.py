"""The goodput benchmark's arithmetic and report: per-policy and per-phase summaries, the
goals, the tables and the chart. No servers here, so ``--replot`` and tests can use it alone.

Every request belongs to the memory phase it was *due* in (its Poisson arrival time), so a
policy's late sends or slow answers never move a request into another phase.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUANTROUTE = "quantroute"
F16, Q8, Q4 = "always-f16", "always-q8_0", "always-q4_k_m"
ROUND_ROBIN, STATIC_TIER = "round-robin", "static-tier"
POLICIES = (QUANTROUTE, F16, Q8, Q4, ROUND_ROBIN, STATIC_TIER)
COLORS = {
    QUANTROUTE: "#1f77b4",
    F16: "#d62728",
    Q8: "#ff7f0e",
    Q4: "#2ca02c",
    ROUND_ROBIN: "#9467bd",
    STATIC_TIER: "#8c564b",
}
GOAL_VS_F16 = 1.5  # goodput over the whole run, quantroute / always-f16
GOAL_VS_STATIC = 1.0  # per phase, quantroute / the best zero-violation static policy


@dataclass(frozen=True, slots=True)
class Bounds:
    """A tier's quality bounds, as the server's router reads them."""

    reference_only: bool
    max_kld: float | None
    min_top1: float | None

    def met_by(self, profile: dict[str, Any]) -> bool:
        if profile.get("reference"):
            return True  # the reference meets every bound, as in the router's filter
        if self.reference_only or self.max_kld == 0.0:
            return False
        if self.max_kld is not None and profile["mean_kld"] > self.max_kld:
            return False
        return self.min_top1 is None or profile["top1"] >= self.min_top1


def static_tier_map(
    profiles: dict[str, dict[str, Any]], bounds: dict[str, Bounds]
) -> dict[str, str]:
    """Each tier's cheapest branch (smallest file) that meets the tier's bound by its profile.

    >>> p = {"m:f16": {"reference": True, "size_bytes": 4}, "m:q4": {"reference": False,
    ...      "size_bytes": 1, "mean_kld": 0.01, "top1": 0.95}}
    >>> static_tier_map(p, {"exact": Bounds(True, 0.0, None), "fast": Bounds(False, None, None)})
    {'exact': 'm:f16', 'fast': 'm:q4'}
    """
    out: dict[str, str] = {}
    for tier, bound in bounds.items():
        meeting = [b for b, prof in profiles.items() if bound.met_by(prof)]
        if meeting:
            out[tier] = min(meeting, key=lambda b: (profiles[b]["size_bytes"], b))
    return out


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it; times are seconds from the run's start."""

    index: int
    tier: str
    target: str  # the model field sent
    due_s: float  # when the Poisson schedule says it arrives
    deadline_ms: float  # from the due time, end to end
    max_tokens: int
    sent_s: float = 0.0
    done_s: float = 0.0
    status: int = 0
    branch: str | None = None  # x-quantroute-branch
    ttft_s: float | None = None  # from the send
    tokens: int = 0
    finish_reason: str | None = None
    complete: bool = False  # [DONE] seen, no error event
    error: str | None = None  # an error code, or the HTTP status, or the exception
    quality_met: bool = False
    deadline_met: bool = False

    @property
    def late_s(self) -> float:
        """How long after its due time the request was handed to the HTTP client."""
        return max(0.0, self.sent_s - self.due_s)

    @property
    def good(self) -> bool:
        return self.quality_met and self.deadline_met

    @property
    def violation(self) -> bool:
        return self.status == 200 and not self.quality_met

    def judge(self, profiles: dict[str, dict[str, Any]], bounds: dict[str, Bounds]) -> None:
        """Set ``quality_met`` and ``deadline_met``.

        The deadline counts from the due time, so a late send is the policy's (the client's)
        loss, and an answer the server cut at the deadline (``finish_reason: deadline``) or
        that came back short is not a met deadline.
        """
        served = profiles.get(self.branch or "") if self.status == 200 else None
        self.quality_met = served is not None and bounds[self.tier].met_by(served)
        self.deadline_met = (
            self.status == 200
            and self.complete
            and self.finish_reason != "deadline"
            and self.tokens >= self.max_tokens
            and (self.done_s - self.due_s) * 1000.0 <= self.deadline_ms
        )


@dataclass(slots=True)
class Run:
    policy: str
    wall_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # what the device showed


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, slots=True)
class Summary:
    """One policy over a span of the run (a phase, or the whole run)."""

    policy: str
    span_s: float
    requests: int
    good: int
    goodput_rps: float
    violations: int
    deadline_missed_200: int  # answered, but late, cut or short
    errors: dict[str, int]
    served_by: dict[str, int]
    mean_kld: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    late_p99_ms: float | None
    late_max_ms: float | None

    @classmethod
    def of(
        cls,
        policy: str,
        outs: Sequence[Outcome],
        span_s: float,
        profiles: dict[str, dict[str, Any]],
    ) -> Summary:
        ok = [o for o in outs if o.status == 200 and o.branch in profiles]
        ttfts = sorted(o.ttft_s * 1000 for o in outs if o.ttft_s is not None)
        lates = sorted(o.late_s * 1000 for o in outs)
        good = sum(o.good for o in outs)
        klds = [profiles[o.branch]["mean_kld"] for o in ok if o.branch]
        return cls(
            policy=policy,
            span_s=span_s,
            requests=len(outs),
            good=good,
            goodput_rps=good / span_s if span_s else 0.0,
            violations=sum(o.violation for o in outs),
            deadline_missed_200=sum(o.status == 200 and not o.deadline_met for o in outs),
            errors=dict(Counter(o.error for o in outs if o.error and o.status != 200)),
            served_by=dict(Counter((o.branch or "?").split(":")[-1] for o in ok)),
            mean_kld=statistics.fmean(klds) if klds else None,
            ttft_p50_ms=statistics.median(ttfts) if ttfts else None,
            ttft_p99_ms=percentile(ttfts, 0.99),
            late_p99_ms=percentile(lates, 0.99),
            late_max_ms=lates[-1] if lates else None,
        )


def by_phase(run: Run, phase_s: float, n_phases: int) -> list[list[Outcome]]:
    """The run's outcomes split by the phase they were due in."""
    out: list[list[Outcome]] = [[] for _ in range(n_phases)]
    for o in run.outcomes:
        out[min(n_phases - 1, int(o.due_s // phase_s))].append(o)
    return out


def summarize(
    runs: Sequence[Run], profiles: dict[str, dict[str, Any]], duration_s: float, n_phases: int
) -> tuple[list[Summary], list[list[Summary]]]:
    """The whole-run summary of each policy, and per phase the summary of each policy."""
    phase_s = duration_s / n_phases
    overall = [Summary.of(r.policy, r.outcomes, duration_s, profiles) for r in runs]
    split = {r.policy: by_phase(r, phase_s, n_phases) for r in runs}
    phases = [
        [Summary.of(r.policy, split[r.policy][i], phase_s, profiles) for r in runs]
        for i in range(n_phases)
    ]
    return overall, phases


@dataclass(frozen=True, slots=True)
class PhaseGoal:
    """Quantroute against the best static policy with zero violations in one phase."""

    best_static: str | None
    static_goodput: float | None
    static_kld: float | None
    quantroute_goodput: float
    quantroute_kld: float | None
    quantroute_violations: int
    ratio: float | None

    @property
    def kld_lower(self) -> bool:
        """Lower mean KLD served; both zero counts (nothing can be lower than the reference)."""
        if self.quantroute_kld is None or self.static_kld is None:
            return self.static_kld is None
        return self.quantroute_kld < self.static_kld or self.static_kld == self.quantroute_kld == 0

    @property
    def met(self) -> bool:
        return (
            self.quantroute_violations == 0
            and (self.ratio is None or self.ratio >= GOAL_VS_STATIC)
            and self.kld_lower
        )


def phase_goal(summaries: Sequence[Summary]) -> PhaseGoal | None:
    by = {s.policy: s for s in summaries}
    qr = by.get(QUANTROUTE)
    if qr is None:
        return None
    clean = [s for s in summaries if s.policy != QUANTROUTE and s.violations == 0]
    best = max(clean, key=lambda s: (s.goodput_rps, -(s.mean_kld or 0.0)), default=None)
    ratio = None
    if best is not None and best.goodput_rps > 0:
        ratio = qr.goodput_rps / best.goodput_rps
    return PhaseGoal(
        best_static=best.policy if best else None,
        static_goodput=best.goodput_rps if best else None,
        static_kld=best.mean_kld if best else None,
        quantroute_goodput=qr.goodput_rps,
        quantroute_kld=qr.mean_kld,
        quantroute_violations=qr.violations,
        ratio=ratio,
    )


def vs_f16(overall: Sequence[Summary]) -> float | None:
    by = {s.policy: s for s in overall}
    qr, f16 = by.get(QUANTROUTE), by.get(F16)
    if qr is None or f16 is None or not f16.goodput_rps:
        return None
    return qr.goodput_rps / f16.goodput_rps


# -- tables -------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


OVERALL_COLUMNS = (
    "Policy", "Goodput (req/s)", "Met both", "Requests", "Violations", "Late/cut 200s",
    "Errors", "Served by", "Mean KLD served", "TTFT p50 (ms)", "TTFT p99 (ms)",
    "Send lateness p99 / max (ms)",
)  # fmt: skip
OVERALL_ALIGN = ("---", "---:", "---:", "---:", "---:", "---:", "---", "---", "---:", "---:",
                 "---:", "---:")  # fmt: skip


def overall_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    return [
        [
            s.policy,
            f"{s.goodput_rps:.2f}",
            f"{s.good}",
            f"{s.requests}",
            f"{s.violations}",
            f"{s.deadline_missed_200}",
            ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "0",
            ", ".join(f"{k} {v}" for k, v in sorted(s.served_by.items())) or "-",
            fmt(s.mean_kld, ".2e"),
            fmt(s.ttft_p50_ms, ".1f"),
            fmt(s.ttft_p99_ms, ".1f"),
            f"{fmt(s.late_p99_ms, '.1f')} / {fmt(s.late_max_ms, '.1f')}",
        ]
        for s in summaries
    ]


METRICS: tuple[tuple[str, str, str], ...] = (
    ("goodput_rps", "Goodput (req/s)", ".2f"),
    ("violations", "Violations", "d"),
    ("mean_kld", "Mean KLD served", ".2e"),
    ("ttft_p99_ms", "TTFT p99 (ms)", ".0f"),
)


def phase_rows(
    metric: str, spec: str, phases: Sequence[Sequence[Summary]], overall: Sequence[Summary]
) -> list[list[str]]:
    """One row per policy: the metric in each phase, then over the whole run."""
    out = []
    for i, s in enumerate(overall):
        cells = [fmt(getattr(ph[i], metric), spec) for ph in phases]
        out.append([s.policy, *cells, fmt(getattr(s, metric), spec)])
    return out


def goal_rows(goals: Sequence[PhaseGoal | None], rooms: Sequence[float]) -> list[list[str]]:
    out = []
    for room, g in zip(rooms, goals, strict=True):
        if g is None:
            continue
        out.append(
            [
                f"{room:g} GiB",
                g.best_static or "none",
                fmt(g.static_goodput, ".2f"),
                fmt(g.quantroute_goodput, ".2f"),
                fmt(g.ratio, ".2f") + ("x" if g.ratio is not None else ""),
                f"{fmt(g.quantroute_kld, '.2e')} vs {fmt(g.static_kld, '.2e')}",
                "met" if g.met else "NOT met",
            ]
        )
    return out


GOAL_COLUMNS = (
    "Phase (room)", "Best zero-violation static", "Its goodput", "quantroute goodput",
    "Ratio", "Mean KLD served, quantroute vs it", "Goal",
)  # fmt: skip


def table(
    columns: Sequence[str],
    body: Sequence[Sequence[str]],
    *,
    markdown: bool,
    align: Sequence[str] | None = None,
) -> str:
    """A plain-text or markdown table; markdown right-aligns all but the first column."""
    if markdown:
        align = align or ["---"] + ["---:"] * (len(columns) - 1)
        lines = [[*columns], [*align], *body]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
    lines = [[*columns], ["-" * w for w in widths], *body]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


# -- the chart ----------------------------------------------------------------


def save_chart(
    overall: Sequence[Summary],
    phases: Sequence[Sequence[Summary]],
    rooms: Sequence[float],
    caption: str,
    path: Path,
) -> None:
    """A 2x2 grid of grouped bars: each metric per phase, one bar per policy."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.2))
    n = len(overall)
    width = 0.8 / max(1, n)
    labels = [f"{r:g} GiB" for r in rooms]
    for ax, (metric, title, _) in zip(axes.flat, METRICS, strict=True):
        for i, s in enumerate(overall):
            values = [getattr(ph[i], metric) for ph in phases]
            xs = [p + (i - (n - 1) / 2) * width for p in range(len(phases))]
            heights = [0.0 if v is None else float(v) for v in values]
            ax.bar(xs, heights, width, color=COLORS.get(s.policy, "0.5"), label=s.policy)
            for x, v in zip(xs, values, strict=True):
                if v is None:  # nothing answered in that phase: no KLD, no TTFT
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(phases)), labels)
        if ax in axes[-1]:
            ax.set_xlabel("memory phase: room for the model's branches", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        if metric == "mean_kld":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    axes.flat[0].legend(fontsize=8, ncol=2)
    fig.text(0.5, 0.005, "\n".join(textwrap.wrap(caption, 190)), ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

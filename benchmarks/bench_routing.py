"""Routing decision latency: ``routing.policy.choose`` on 4, 16 and 64 branches.

Each size is a realistic candidate list: several models x precisions x
devices, with a mix of feasible and infeasible branches (not ready,
degraded, unprofiled, too little memory, too slow for the deadline) and
devices in all three memory regimes. Requests cycle through tiers, explicit
bounds, deadlines and prompt prefixes, so every path of the policy runs.

Every decision is timed on its own with ``time.perf_counter_ns`` after a
warm-up, garbage collection left on (as in the server). A run repeats the
whole measurement ``--rounds`` times and reports the median of each round's
percentiles, so one noisy round on a shared machine does not decide.

Also shown: the cost of building the ``BranchState`` list itself (what the
caller pays when it rebuilds states per request rather than per telemetry
tick) and of reading a decision's ``explanations`` (built on demand).

    python benchmarks/bench_routing.py               # the table
    python benchmarks/bench_routing.py --markdown    # rows for docs/benchmarks.md

Goal: p99 <= 50 us with 16 branches.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from quantroute.errors import ServiceUnavailableError
from quantroute.routing.policy import choose
from quantroute.routing.records import BranchState, RequestShape
from quantroute.routing.requirement import Requirement, parse_requirement
from quantroute.routing.settings import GiB, RoutingSettings
from quantroute.types import Precision

SIZES = (4, 16, 64)
GOAL_US = 50.0
GOAL_SIZE = 16

# (precision, mean_kld, top1, prefill_tps, decode_tps), shaped like the demo's profile
PRECISIONS = (
    (Precision.F16, 0.0, 1.0, 28_000.0, 5_500.0),
    (Precision.Q8_0, 0.00027, 0.991, 27_700.0, 7_100.0),
    (Precision.Q5_K_M, 0.004, 0.97, 40_000.0, 10_000.0),
    (Precision.Q4_K_M, 0.0103, 0.942, 60_000.0, 15_000.0),
)
# (free bytes, health, heat): ample, constrained, tight, nearly full
DEVICES = (
    (20 * GiB, 1.0, 0.1),
    (6 * GiB, 0.9, 0.3),
    (3 * GiB, 1.0, 0.0),
    (64 * 2**20, 0.7, 0.6),
)


def layout(n: int) -> tuple[int, int]:
    """(models, devices) so that models * 4 precisions * devices == n."""
    return {4: (1, 1), 16: (2, 2), 64: (4, 4)}.get(n) or (max(1, n // 4), 1)


def branch_fields(n: int) -> list[dict[str, Any]]:
    """Fields of ``n`` branches: models x precisions x devices, every kind of infeasibility."""
    models, devices = layout(n)
    out: list[dict[str, Any]] = []
    k = 0
    for m in range(models):
        model = f"model-{m}"
        for d in range(devices):
            free, health, heat = DEVICES[(d + 2 * m) % len(DEVICES)]
            for precision, kld, top1, prefill, decode in PRECISIONS:
                bad = k % 7  # a deterministic mix of troubles
                out.append(
                    dict(
                        id=f"{model}:{precision.value}@{d}",
                        model=model,
                        name=f"{precision.value}@{d}",
                        precision=precision,
                        is_reference=precision is Precision.F16,
                        ready=bad not in (3, 5),
                        degraded=bad == 6 and precision is not Precision.F16,
                        mean_kld=None if bad == 4 and k % 2 else kld,
                        top1=None if bad == 4 and k % 2 else top1,
                        prefill_tps=prefill,
                        decode_tps=decode,
                        kv_bytes_per_token=128 * 1024,
                        device=f"cuda:{d}",
                        device_free_bytes=free,
                        device_total_bytes=24 * GiB,
                        device_health=health,
                        running=k % 5,
                        parallel=4,
                        queued=k % 3,
                        recent_rate=float(k % 11),
                        heat=heat,
                    )
                )
                k += 1
    return out


def make_branches(n: int) -> list[BranchState]:
    """``n`` branch states (see :func:`branch_fields`)."""
    return [BranchState(**f) for f in branch_fields(n)]


def make_requests(settings: RoutingSettings) -> list[tuple[Requirement, RequestShape]]:
    """A cycle of requirements and shapes covering tiers, bounds, deadlines, prefixes."""
    qualities: list[tuple[object, str | None, str | None]] = [
        (None, None, None),
        ("high", None, None),
        (None, "balanced", "2000"),
        ({"max_kld": 0.005}, None, None),
        ("fast", None, "250"),
        (None, "max_kld=0.02,min_top1=0.9", "800"),
    ]
    shapes = [
        RequestShape(prompt_tokens=p, max_tokens=t, prefix=f"system prompt {i % 8}")
        for i, (p, t) in enumerate([(128, 64), (512, 256), (2048, 512), (64, 16), (1024, 128)])
    ]
    return [
        (parse_requirement(q, h, dl, None, settings), shape)
        for q, h, dl in qualities
        for shape in shapes
    ]


@dataclass(frozen=True, slots=True)
class Result:
    size: int
    feasible_share: float
    p50_us: float
    p99_us: float
    mean_us: float
    build_us: float
    explain_us: float


def _percentile(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def _time_each(fn: Callable[[], object], iterations: int) -> list[int]:
    clock = time.perf_counter_ns
    samples = [0] * iterations
    for i in range(iterations):
        t0 = clock()
        fn()
        samples[i] = clock() - t0
    samples.sort()
    return samples


def measure(size: int, iterations: int, warmup: int, settings: RoutingSettings) -> Result:
    """One round for one size."""
    branches = make_branches(size)
    requests = make_requests(settings)
    cycle = len(requests)
    state = {"i": 0}

    def decide() -> object:
        requirement, shape = requests[state["i"] % cycle]
        state["i"] += 1
        try:
            return choose("m", requirement, shape, branches, settings)
        except ServiceUnavailableError as exc:
            return exc

    for _ in range(warmup):
        decide()
    gc.collect()
    samples = _time_each(decide, iterations)

    feasible = 0
    for requirement, shape in requests:
        try:
            d = choose("m", requirement, shape, branches, settings)
            feasible += sum(e.feasible for e in d.explanations)
        except ServiceUnavailableError:
            pass
    fields = branch_fields(size)
    build = _time_each(lambda: [BranchState(**f) for f in fields], max(50, iterations // 100))
    first = choose("m", requests[0][0], requests[0][1], branches, settings)
    explain = _time_each(lambda: first.explanations, max(50, iterations // 100))
    return Result(
        size=size,
        feasible_share=feasible / (size * cycle),
        p50_us=_percentile(samples, 0.50),
        p99_us=_percentile(samples, 0.99),
        mean_us=sum(samples) / len(samples) / 1000.0,
        build_us=_percentile(build, 0.50),
        explain_us=_percentile(explain, 0.50),
    )


def median_result(rounds: Sequence[Result]) -> Result:
    """Field-wise median over rounds."""

    def med(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in rounds))

    return Result(
        size=rounds[0].size,
        feasible_share=rounds[0].feasible_share,
        p50_us=med("p50_us"),
        p99_us=med("p99_us"),
        mean_us=med("mean_us"),
        build_us=med("build_us"),
        explain_us=med("explain_us"),
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="timed decisions per size")
    parser.add_argument("--warmup", type=int, default=2_000, help="untimed decisions first")
    parser.add_argument("--rounds", type=int, default=5, help="repeat; report medians")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md rows")
    args = parser.parse_args(argv)

    settings = RoutingSettings()
    results: list[Result] = []
    for size in args.sizes:
        rounds = [measure(size, args.iterations, args.warmup, settings) for _ in range(args.rounds)]
        results.append(median_result(rounds))
        spread = sorted(r.p99_us for r in rounds)
        print(
            f"{size:>3} branches: p99 per round {', '.join(f'{v:.1f}' for v in spread)} us",
            file=sys.stderr,
        )

    header = (
        "| Branches | Feasible | p50 (µs) | p99 (µs) | mean (µs) | build states (µs) "
        "| explanations (µs) |"
    )
    print()
    print(
        f"_Measured on {date.today().isoformat()}, {cpu_name()} ({os.cpu_count()} cores), "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
        f"{args.rounds} rounds x {args.iterations} decisions, medians of the rounds._"
    )
    print()
    print(header)
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.size} | {r.feasible_share:.0%} | {r.p50_us:.1f} | {r.p99_us:.1f} "
            f"| {r.mean_us:.1f} | {r.build_us:.1f} | {r.explain_us:.1f} |"
        )
    goal = next((r for r in results if r.size == GOAL_SIZE), None)
    if goal is not None:
        verdict = "met" if goal.p99_us <= GOAL_US else "NOT met"
        line = f"Goal p99 <= {GOAL_US:.0f} µs with {GOAL_SIZE} branches: {verdict}"
        print()
        print(f"- {line} ({goal.p99_us:.1f} µs)." if args.markdown else line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

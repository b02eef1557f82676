"""Routing decision latency as a request sees it: state building included.

``bench_routing.py`` times the policy (``routing.policy.choose``) on prepared
``BranchState`` lists. A request pays more: ``Service.route`` looks the model
up in the live route table, builds one ``BranchState`` per branch from the live
parts (residency, breakers, drift, the device snapshot, health, popularity,
engine load) and then decides. This times that call on a real ``Gateway``
(``create_app`` with ``FakeEngine`` branches on simulated devices, its device
poller running) with one model of 4 precisions x 4 replicas = 16 branches (and
4 and 64 for the trend), requests cycling through tiers, deadlines and prompt
prefixes, and each decision counted in the popularity as the server does.

Each call is timed on its own with ``time.perf_counter_ns`` after a warm-up,
garbage collection on; a run repeats ``--rounds`` times and reports the median
of the rounds' percentiles.

Three loads: **steady** (no request runs, so only popularity moves the records, and
the policy's ranking is reused while the states hold); **churn** (after each
decision its primary's load moves, 0 -> 1 -> 2 -> 0 sequences, as requests starting
and finishing do, so one branch's record changes every request: a busy server; a
load coming back to an earlier value gets its earlier record back, and the policy
what it computed for it); and **new-load** (the primary's load climbs through 0..39
sequences, so nearly every record and its row and score are new: the worst case).

    python benchmarks/bench_decision.py [--markdown]

Goal: p99 <= 50 us with 16 branches.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from quantroute.api.app import create_app
from quantroute.api.schemas import CompletionRequest
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision

GOAL_US = 50.0
# (precision, mean_kld, top1, prefill tok/s, decode tok/s), shaped like the demo's profile
PRECISIONS = (
    (Precision.F16, 0.0, 1.0, 28_000.0, 5_500.0),
    (Precision.Q8_0, 0.00027, 0.991, 27_700.0, 7_100.0),
    (Precision.Q5_K_M, 0.004, 0.97, 40_000.0, 10_000.0),
    (Precision.Q4_K_M, 0.0103, 0.942, 60_000.0, 15_000.0),
)
REQUESTS = (
    {"quality": "exact"},
    {"quality": "balanced"},
    {"quality": "fast"},
    {"quality": {"max_kld": 0.005}},
    {"quality": "balanced", "timeout": 2.0},
    {"quality": "fast", "timeout": 0.5},
)


def table(n: int) -> RouteTable:
    """One model, ``n`` branches: the 4 precisions, ``n // 4`` replicas each."""
    branches = []
    for r in range(n // 4):
        for precision, kld, top1, prefill, decode in PRECISIONS:
            name = f"{precision.value}-{r}"
            ref = precision is Precision.F16 and r == 0
            artifact = BranchArtifact(
                "m", name, precision, "fake", Path(f"/{name}.gguf"), "0" * 64, 0, ref
            )
            profile = SimpleNamespace(
                mean_kld=kld, top1=top1, prefill_tps=prefill, decode_tps=decode
            )
            engine = FakeEngine(n_ctx=4096)
            branches.append(Branch("m", name, precision, artifact, engine, profile))  # type: ignore[arg-type]
    return RouteTable.build([ModelRoute("m", "f16-0", tuple(branches))])


async def measure(n: int, iterations: int, warmup: int, load: str) -> dict[str, float]:
    settings = load_settings(
        telemetry={"devices": "sim:4x24GiB", "poll_interval_s": 0.5},
        server={"log_level": "warning"},
        observability={"access_log": False},
    )
    app = create_app(settings, table=table(n))
    async with app.router.lifespan_context(app):
        gateway = app.state.gateway
        service = gateway.service
        prompts = [f"prompt {i} " * 8 for i in range(8)]
        calls = []
        for i in range(64):
            req = CompletionRequest(
                model="m",
                prompt=prompts[i % len(prompts)],
                max_tokens=64,
                **REQUESTS[i % len(REQUESTS)],
            )
            requirement, shape = service._routing_inputs(req, {})
            calls.append((req, requirement, shape))
        record = gateway.popularity.record
        engines = {b.id: b.engine for b in gateway.routes.current.branches()}
        times: list[int] = []
        clock = time.perf_counter_ns
        for i in range(warmup + iterations):
            req, requirement, shape = calls[i % len(calls)]
            t0 = clock()
            decision, _ = service.route(req, requirement, shape)
            t1 = clock()
            if decision.branch_ids:
                record(decision.branch_ids[0])
                if load != "steady":  # the primary's load moves, as requests come and go
                    engine = engines[decision.branch_ids[0]]
                    engine._in_flight = (engine._in_flight + 1) % (3 if load == "churn" else 40)
            if i >= warmup:
                times.append(t1 - t0)
            if i % 512 == 0:
                await asyncio.sleep(0)  # let the device poller run, as in the server
    times.sort()
    return {
        "p50_us": times[len(times) // 2] / 1000,
        "p99_us": times[int(len(times) * 0.99)] / 1000,
        "mean_us": statistics.fmean(times) / 1000,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--iterations", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=2_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--markdown", action="store_true")
    loads = ["steady", "churn", "new-load"]
    p.add_argument("--loads", nargs="+", choices=loads, default=loads)
    args = p.parse_args(argv)
    rows = []
    for load in args.loads:
        for n in args.sizes:
            rounds = [
                asyncio.run(measure(n, args.iterations, args.warmup, load))
                for _ in range(args.rounds)
            ]
            row = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            rows.append((load, n, row))
            print(
                f"{load:8s} {n:3d} branches: p50 {row['p50_us']:.1f} us, "
                f"p99 {row['p99_us']:.1f} us, mean {row['mean_us']:.1f} us",
                flush=True,
            )
    if args.markdown:
        print(
            "\n| Load | Branches | p50 (µs) | p99 (µs) | mean (µs) |\n"
            "| --- | ---: | ---: | ---: | ---: |"
        )
        for load, n, row in rows:
            print(
                f"| {load} | {n} | {row['p50_us']:.1f} | {row['p99_us']:.1f} "
                f"| {row['mean_us']:.1f} |"
            )
    for load, n, row in rows:
        if n == 16:
            met = row["p99_us"] <= GOAL_US
            print(
                f"goal p99 <= {GOAL_US:g} us at 16 branches, {load}: {'met' if met else 'NOT met'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

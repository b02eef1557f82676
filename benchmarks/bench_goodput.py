"""Goodput benchmark: quantroute's per-request routing vs three static policies.

A mixed workload (``exact``, ``balanced`` and ``fast`` requests, all with a deadline) runs
against the demo model ``tiny-llama`` on one simulated device whose memory shrinks during the
run. Four policies are compared, each against a fresh ``quantroute serve`` (so residency state
does not carry over), with the same seeded request schedule and the same memory schedule:

* **quantroute** -- ``"model": "tiny-llama"`` and the request's ``quality`` tier: the router
  picks the branch per request;
* **always f16** -- every request pinned to ``tiny-llama:f16``;
* **always q4_k_m** -- every request pinned to ``tiny-llama:q4_k_m``;
* **round-robin** -- requests pinned to f16, q8_0, q4_k_m in turn.

For the static policies the tier is the client's bookkeeping only (it is not sent). Every
request carries ``x-quantroute-deadline-ms``. A request **met its quality bound** iff it was
answered (HTTP 200) by a branch that meets its tier's bounds by the branch's measured profile
(``exact``: the reference branch only; the bounds are read from ``POST /v1/route/explain``).
It **met its deadline** iff its stream completed (200, no error event, ``[DONE]``) within the
deadline, end to end from the moment it was sent. **Goodput** is the number of requests that
met both, per second of the run. A **violation** is a 200 answer from a branch that does not
meet the request's tier (quantroute must have none).

The memory schedule is a list of phases of equal length. Each phase sets the *room for the
model*: the device memory left to the model's branches after other tenants and the safety
margin, i.e. ``total - safety margin - pressure``. The script measures that room once at start
(``free_for_routing + used``, with no pressure) and sets ``PUT /admin/devices/sim:0/pressure``
to ``room0 - target`` at each phase start. (Targeting free-for-routing itself would make the
pressure depend on which branches the policy's traffic kept loaded, so the schedule would
differ between policies.) With ``--telemetry-sim-weight-scale 2000`` the branches occupy about
7.1, 3.8 and 2.2 GiB (f16, q8_0, q4_k_m; 13.1 GiB together), so the default rooms
(20, 12, 7, 5, 3 GiB) go: all three loaded; one must leave; f16 no longer fits at all; q8_0
and q4_k_m no longer fit together; only q4_k_m fits.

Output: progress lines, a table per policy (goodput, requests, violations, errors by code,
mean KLD served, TTFT p50/p99), the ratio of quantroute's goodput to always-f16's and whether
the goal (>= 1.5x with zero violations) is met; ``--markdown`` adds a table for
docs/benchmarks.md. JSON goes to ``benchmarks/results/goodput-<date>.json``, the plot of
goodput over time to ``docs/img/bench_goodput.png``, the servers' logs to
``benchmarks/results/logs/``.

Run::

    .venv/bin/python benchmarks/bench_goodput.py                 # ~3 minutes
    .venv/bin/python benchmarks/bench_goodput.py --duration-s 10 --rate 4   # a smoke run
    .venv/bin/python benchmarks/bench_goodput.py --markdown
    .venv/bin/python benchmarks/bench_goodput.py --replot benchmarks/results/goodput-DATE.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import logging
import math
import os
import platform
import random
import secrets
import signal
import statistics
import sys
import textwrap
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from servers import Server, free_port, quantroute_command

log = logging.getLogger("bench_goodput")

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_CHART = ROOT / "docs" / "img" / "bench_goodput.png"
GIB = 1 << 30

MODEL = "tiny-llama"
QUANTROUTE, F16, Q4, ROUND_ROBIN = "quantroute", "always-f16", "always-q4_k_m", "round-robin"
POLICIES = (QUANTROUTE, F16, Q4, ROUND_ROBIN)
PINS: dict[str, tuple[str, ...]] = {
    QUANTROUTE: (),
    F16: ("f16",),
    Q4: ("q4_k_m",),
    ROUND_ROBIN: ("f16", "q8_0", "q4_k_m"),
}
COLORS = {QUANTROUTE: "#1f77b4", F16: "#d62728", Q4: "#2ca02c", ROUND_ROBIN: "#9467bd"}
GOAL_RATIO = 1.5  # goodput, quantroute / always-f16, with zero violations
PROMPTS = (
    "def main():\n",
    "Once upon a time",
    "The capital of France is",
    "import numpy as np\n",
    "Q: What is two plus two?\nA:",
)


# -- the workload -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the schedule: when it is due (s from the run's start), its tier."""

    index: int
    due_s: float
    tier: str
    prompt: str


def schedule(args: argparse.Namespace) -> list[Planned]:
    """A seeded Poisson arrival schedule over the run: the same for every policy."""
    rng = random.Random(args.seed)
    tiers, weights = zip(*args.mix.items(), strict=True)
    out: list[Planned] = []
    t = rng.expovariate(args.rate)
    while t < args.duration_s:
        tier = rng.choices(tiers, weights)[0]
        out.append(Planned(len(out), t, tier, rng.choice(PROMPTS)))
        t += rng.expovariate(args.rate)
    return out


@dataclass(frozen=True, slots=True)
class Bounds:
    """A tier's quality bounds, as the server's router reads them."""

    reference_only: bool
    max_kld: float | None
    min_top1: float | None

    def met_by(self, profile: dict[str, Any]) -> bool:
        if self.reference_only:
            return bool(profile.get("reference"))
        if self.max_kld is not None and profile["mean_kld"] > self.max_kld:
            return False
        return self.min_top1 is None or profile["top1"] >= self.min_top1


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it; times are seconds from the run's start."""

    index: int
    tier: str
    target: str  # the model field sent
    sent_s: float
    done_s: float = 0.0
    status: int = 0
    branch: str | None = None  # x-quantroute-branch
    ttft_s: float | None = None
    tokens: int = 0
    complete: bool = False  # [DONE] seen, no error event
    error: str | None = None  # an error code, or the HTTP status, or the exception
    quality_met: bool = False
    deadline_met: bool = False

    @property
    def good(self) -> bool:
        return self.quality_met and self.deadline_met

    @property
    def violation(self) -> bool:
        return self.status == 200 and not self.quality_met


# -- the server ---------------------------------------------------------------

ADMIN_KEY = secrets.token_urlsafe(16)  # the pressure endpoint is an admin one


def make_server(args: argparse.Namespace, policy: str) -> Server:
    command = quantroute_command()
    port = free_port()
    argv = [
        command, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--devices", args.devices, "--telemetry-sim-weight-scale", str(args.weight_scale),
        "--telemetry-poll-interval-s", str(args.poll_interval_s),
        "--server-log-level", "warning", "--server-admin-key", ADMIN_KEY,
    ]  # fmt: skip
    return Server(policy, argv, port, "/readyz", RESULTS_DIR / "logs" / f"goodput-{policy}.log")


# -- one policy's run ---------------------------------------------------------


@dataclass(slots=True)
class Run:
    policy: str
    wall_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # what the device showed
    late_sends: int = 0  # requests sent more than 100 ms after they were due


async def devices(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/v1/devices")
    resp.raise_for_status()
    body: dict[str, Any] = resp.json()
    return body


def loaded(snapshot: dict[str, Any]) -> list[str]:
    return [b for b, v in snapshot["branches"].items() if v.get("ready")]


async def read_model(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Bounds]]:
    """The branches' profiles (plus ``reference``) and every tier's bounds."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    model = next(m for m in resp.json()["data"] if m["id"] == MODEL)
    profiles = {b["id"]: b["profile"] | {"reference": b["reference"]} for b in model["branches"]}
    bounds: dict[str, Bounds] = {}
    for tier in ("exact", "high", "balanced", "fast"):
        body = {"model": MODEL, "prompt": "x", "quality": tier}
        req = (await client.post("/v1/route/explain", json=body)).json()["requirement"]
        bounds[tier] = Bounds(tier == "exact", req["max_kld"], req["min_top1"])
    return profiles, bounds


async def send(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    planned: Planned,
    target: str,
    t0: float,
) -> Outcome:
    body: dict[str, Any] = {
        "model": target,
        "prompt": planned.prompt,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target == MODEL:
        body["quality"] = planned.tier
    headers = {"x-quantroute-deadline-ms": str(args.deadline_ms)}
    out = Outcome(planned.index, planned.tier, target, time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status_code
            out.branch = r.headers.get("x-quantroute-branch")
            if r.status_code != 200:
                raw = await r.aread()
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    out.error = json.loads(raw)["error"]["code"]
                out.error = out.error or f"http_{r.status_code}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out.complete = out.error is None
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = str(chunk["error"].get("code") or "stream_error")
                        continue
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - t0 - out.sent_s
                    if chunk.get("usage"):
                        out.tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    out.done_s = time.perf_counter() - t0
    return out


async def pressure_schedule(
    client: httpx.AsyncClient, args: argparse.Namespace, room0: int, t0: float, run: Run
) -> None:
    """Set the pressure at every phase start; note what is loaded just before the next."""
    phase_s = args.duration_s / len(args.phases_gib)
    for i, target in enumerate(args.phases_gib):
        await asyncio.sleep(max(0.0, t0 + i * phase_s - time.perf_counter()))
        pressure = max(0, room0 - int(target * GIB))
        resp = await client.put(
            "/admin/devices/sim:0/pressure",
            json={"bytes": pressure},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        resp.raise_for_status()
        await asyncio.sleep(max(0.0, t0 + (i + 1) * phase_s - 0.3 - time.perf_counter()))
        snap = await devices(client)
        mem = snap["data"][0]["memory"]
        run.phases.append(
            {
                "room_gib": target,
                "pressure_bytes": pressure,
                "free_for_routing_gib": mem["free_for_routing_bytes"] / GIB,
                "loaded_at_end": loaded(snap),
            }
        )
        log.info(
            "  %-13s phase %d: room %4.1f GiB, free-for-routing %5.2f GiB, loaded %s",
            *(run.policy, i + 1, target, mem["free_for_routing_bytes"] / GIB),
            ", ".join(b.split(":")[1] for b in loaded(snap)) or "nothing",
        )


async def run_policy(
    args: argparse.Namespace, policy: str, plan: list[Planned]
) -> tuple[Run, dict[str, Any], dict[str, Bounds]]:
    server = make_server(args, policy)
    run = Run(policy)
    try:
        server.start()
        await asyncio.to_thread(server.wait_ready, args.start_timeout_s)
        limits = httpx.Limits(max_connections=args.workers + 4)
        timeout = httpx.Timeout(args.deadline_ms / 1000.0 + 30.0)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as c:
            profiles, bounds = await read_model(c)
            # Warm-up, the same for every policy: one request per branch and one routed.
            for target in [f"{MODEL}:{b}" for b in PINS[ROUND_ROBIN]] + [MODEL]:
                await send(c, args, Planned(-1, 0.0, "fast", PROMPTS[0]), target, 0.0)
            await asyncio.sleep(2 * args.poll_interval_s)
            snap = await devices(c)
            mem = snap["data"][0]["memory"]
            room0 = mem["free_for_routing_bytes"] + mem["used_bytes"]  # no pressure yet
            log.info(
                "%s: server ready on port %d; room for the model %.1f GiB, loaded %s",
                *(policy, server.port, room0 / GIB, ", ".join(loaded(snap))),
            )
            queue: asyncio.Queue[Planned] = asyncio.Queue()
            for p in plan:
                queue.put_nowait(p)
            pins = PINS[policy]
            t0 = time.perf_counter()

            async def worker() -> None:
                while not queue.empty():
                    p = queue.get_nowait()
                    wait = t0 + p.due_s - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    elif wait < -0.1:
                        run.late_sends += 1
                    target = f"{MODEL}:{pins[p.index % len(pins)]}" if pins else MODEL
                    run.outcomes.append(await send(c, args, p, target, t0))

            await asyncio.gather(
                pressure_schedule(c, args, room0, t0, run),
                *(worker() for _ in range(args.workers)),
            )
            run.wall_s = max(args.duration_s, time.perf_counter() - t0)
    finally:
        server.stop()  # not in a thread: a cancelled task (Ctrl-C) must still get here to the end
    for o in run.outcomes:
        served = profiles.get(o.branch or "") if o.status == 200 else None
        o.quality_met = served is not None and bounds[o.tier].met_by(served)
        o.deadline_met = (
            o.status == 200 and o.complete and (o.done_s - o.sent_s) * 1000 <= args.deadline_ms
        )
    run.outcomes.sort(key=lambda o: o.index)
    return run, profiles, bounds


# -- reporting ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    requests: int
    good: int
    goodput_rps: float
    violations: int
    deadline_missed_200: int  # answered, but late or cut
    errors: dict[str, int]
    served_by: dict[str, int]
    mean_kld: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    late_sends: int

    @classmethod
    def of(cls, run: Run, profiles: dict[str, Any]) -> Summary:
        outs = run.outcomes
        ok = [o for o in outs if o.status == 200 and o.branch in profiles]
        ttfts = sorted(o.ttft_s * 1000 for o in outs if o.ttft_s is not None)
        good = sum(o.good for o in outs)
        klds = [profiles[o.branch]["mean_kld"] for o in ok if o.branch]
        return cls(
            policy=run.policy,
            requests=len(outs),
            good=good,
            goodput_rps=good / run.wall_s if run.wall_s else 0.0,
            violations=sum(o.violation for o in outs),
            deadline_missed_200=sum(o.status == 200 and not o.deadline_met for o in outs),
            errors=dict(Counter(o.error for o in outs if o.error and o.status != 200)),
            served_by=dict(Counter((o.branch or "?").split(":")[-1] for o in ok)),
            mean_kld=statistics.fmean(klds) if klds else None,
            ttft_p50_ms=statistics.median(ttfts) if ttfts else None,
            ttft_p99_ms=percentile(ttfts, 0.99),
            late_sends=run.late_sends,
        )


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank percentile."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = (
    "Policy", "Goodput (req/s)", "Met both", "Requests", "Violations", "Errors",
    "Served by", "Mean KLD served", "TTFT p50 (ms)", "TTFT p99 (ms)",
)  # fmt: skip


def rows(summaries: list[Summary]) -> list[list[str]]:
    return [
        [
            s.policy,
            f"{s.goodput_rps:.2f}",
            f"{s.good}",
            f"{s.requests}",
            f"{s.violations}",
            ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "0",
            ", ".join(f"{k} {v}" for k, v in sorted(s.served_by.items())) or "-",
            _fmt(s.mean_kld, ".2e"),
            _fmt(s.ttft_p50_ms, ".1f"),
            _fmt(s.ttft_p99_ms, ".1f"),
        ]
        for s in summaries
    ]


def headline(summaries: list[Summary]) -> tuple[float | None, bool, list[str]]:
    by = {s.policy: s for s in summaries}
    qr, f16 = by.get(QUANTROUTE), by.get(F16)
    ratio = qr.goodput_rps / f16.goodput_rps if qr and f16 and f16.goodput_rps else None
    met = qr is not None and ratio is not None and ratio >= GOAL_RATIO and qr.violations == 0
    lines = [
        f"goodput quantroute / always-f16: {_fmt(ratio, '.2f')}x",
        f"quantroute quality-bound violations: {qr.violations if qr else '-'}",
        f"goal (>= {GOAL_RATIO}x always-f16's goodput, zero violations): "
        + ("met" if met else "NOT met"),
    ]
    return ratio, met, lines


def plain_table(table: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(COLUMNS)]
    lines = [[*COLUMNS], ["-" * w for w in widths], *table]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def markdown_table(table: list[list[str]], lines: list[str], caption: str) -> str:
    align = ["---"] + ["---:"] * 4 + ["---", "---"] + ["---:"] * 3
    body = ["| " + " | ".join(r) + " |" for r in [[*COLUMNS], align, *table]]
    return "\n".join([caption, "", *body, "", *(f"- {line}" for line in lines)])


def save_chart(
    runs: list[Run], args: argparse.Namespace, caption: str, path: Path, ratio: float | None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    phase_s = args.duration_s / len(args.phases_gib)
    for i, room in enumerate(args.phases_gib):
        ax.axvspan(i * phase_s, (i + 1) * phase_s, color="0.93" if i % 2 else "0.85", lw=0)
        ax.text((i + 0.5) * phase_s, 1.0, f"{room:g} GiB", transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    n_bins = max(1, math.ceil(args.duration_s / args.bin_s))
    edges = [min(b * args.bin_s, args.duration_s) for b in range(n_bins + 1)]
    centers = [(lo + hi) / 2 for lo, hi in itertools.pairwise(edges)]
    widths = [hi - lo for lo, hi in itertools.pairwise(edges)]
    for run in runs:
        counts = [0] * n_bins
        for o in run.outcomes:
            if o.good:  # binned by completion; the few that finish after the run go last
                counts[min(n_bins - 1, int(o.done_s // args.bin_s))] += 1
        style = {"lw": 2.4} if run.policy == QUANTROUTE else {"lw": 1.4, "ls": "--"}
        rates = [c / w for c, w in zip(counts, widths, strict=True)]
        ax.plot(centers, rates, marker="o", ms=3, color=COLORS[run.policy], label=run.policy,
                **style)  # fmt: skip
    ax.set_xlim(0, args.duration_s)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time in the run (s); shading: the memory phases (room for the model's branches)")
    ax.set_ylabel(f"goodput (req/s, {args.bin_s:g} s bins)")
    title = "Requests meeting quality bound and deadline, per second"
    if ratio is not None:
        title += f" (quantroute / always-f16: {ratio:.2f}x)"
    ax.set_title(title, fontsize=10, pad=16)
    ax.legend(loc="lower left", fontsize=9)
    fig.text(0.5, 0.01, "\n".join(textwrap.wrap(caption, 170)), ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


# -- main ---------------------------------------------------------------------


def parse_mix(text: str) -> dict[str, float]:
    """``exact=20,balanced=40,fast=40`` -> weights per tier."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        tier, _, weight = part.partition("=")
        if tier.strip() not in ("exact", "high", "balanced", "fast"):
            raise argparse.ArgumentTypeError(f"unknown tier {tier!r}")
        mix[tier.strip()] = float(weight)
    return mix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--duration-s", type=float, default=40.0, help="per policy")
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--workers", type=int, default=4, help="concurrent client workers")
    p.add_argument("--mix", type=parse_mix, default="exact=20,balanced=40,fast=40")
    p.add_argument("--deadline-ms", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--phases-gib",
        type=float,
        nargs="+",
        default=[20.0, 12.0, 7.0, 5.0, 3.0],
        help="room for the model's branches in each phase (total - safety margin - pressure)",
    )
    p.add_argument("--devices", default="sim:1x24GiB")
    p.add_argument("--weight-scale", type=float, default=2000.0)
    p.add_argument("--poll-interval-s", type=float, default=0.5)
    p.add_argument("--bin-s", type=float, default=4.0, help="plot bin width")
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/...)")
    p.add_argument("--chart", type=Path, default=DEFAULT_CHART)
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--replot", type=Path, help="report again from a saved JSON; no servers")
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.rate <= 0 or args.workers < 1:
        p.error("--duration-s and --rate must be > 0, --workers >= 1")
    if isinstance(args.mix, str):
        args.mix = parse_mix(args.mix)
    return args


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through the finally that stops the server


def report(
    args: argparse.Namespace,
    runs: list[Run],
    profiles: dict[str, Any],
    bounds: dict[str, Bounds],
    now: dt.datetime,
    host: dict[str, Any],
    out: Path | None,
) -> None:
    """Print the table and the headline; write the JSON (unless ``out`` is None) and chart."""
    summaries = [Summary.of(r, profiles) for r in runs]
    ratio, met, lines = headline(summaries)
    table = rows(summaries)
    mix = ", ".join(f"{t} {w:g}%" for t, w in args.mix.items())
    n_requests = len(runs[0].outcomes) if runs else 0
    settings = (
        f"{MODEL} on {args.devices} (weight scale {args.weight_scale:g}); {n_requests} requests "
        f"in {args.duration_s:g} s per policy (Poisson, {args.rate:g}/s, seed {args.seed}; "
        f"{mix}); {args.workers} workers; max_tokens {args.max_tokens}; deadline "
        f"{args.deadline_ms} ms; rooms {' -> '.join(f'{r:g}' for r in args.phases_gib)} GiB"
    )
    print(f"\n{settings}\n\n{plain_table(table)}\n")
    print("\n".join(lines))
    for run in runs:
        loaded_per_phase = [
            "+".join(b.split(":")[1] for b in ph["loaded_at_end"]) or "-" for ph in run.phases
        ]
        print(f"{run.policy}: loaded at the end of each phase: {' | '.join(loaded_per_phase)}")
    where = f"{now:%Y-%m-%d}, {host['cpu']} ({host['cpus']} CPUs), {host['platform']}"
    if args.markdown:
        print("\n" + markdown_table(table, lines, f"_Measured on {where}; {settings}._"))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "date": now.isoformat(timespec="seconds"),
            "machine": host,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "profiles": profiles,
            "bounds": {k: asdict(v) for k, v in bounds.items()},
            "ratio_vs_f16": ratio,
            "goal_met": met,
            "summaries": [asdict(s) for s in summaries],
            "runs": [
                {
                    "policy": r.policy,
                    "wall_s": r.wall_s,
                    "late_sends": r.late_sends,
                    "phases": r.phases,
                    "outcomes": [asdict(o) for o in r.outcomes],
                }
                for r in runs
            ],
        }
        out.write_text(json.dumps(body, indent=2) + "\n")
        log.info("wrote %s", out)
    if not args.no_chart:
        save_chart(runs, args, f"{settings}; {where}", args.chart, ratio)
        log.info("wrote %s", args.chart)


def replot(args: argparse.Namespace) -> None:
    """Report again from a saved JSON file, with this invocation's output flags."""
    saved = json.loads(args.replot.read_text())
    for key, value in saved["settings"].items():
        if key not in ("markdown", "chart", "no_chart", "replot", "out"):
            setattr(args, key, value)
    runs = [
        Run(
            r["policy"],
            r["wall_s"],
            [Outcome(**o) for o in r["outcomes"]],
            r["phases"],
            r["late_sends"],
        )
        for r in saved["runs"]
    ]
    bounds = {k: Bounds(**v) for k, v in saved["bounds"].items()}
    now = dt.datetime.fromisoformat(saved["date"])
    report(args, runs, saved["profiles"], bounds, now, saved["machine"], None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.replot is not None:
        replot(args)
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    now = dt.datetime.now().astimezone()
    host = machine()
    plan = schedule(args)
    log.info(
        "%d requests over %.0f s per policy (%s), deadline %d ms, rooms %s GiB",
        *(len(plan), args.duration_s, dict(Counter(p.tier for p in plan)), args.deadline_ms),
        args.phases_gib,
    )
    runs: list[Run] = []
    profiles: dict[str, Any] = {}
    bounds: dict[str, Bounds] = {}
    try:
        for policy in args.policies:
            run, profiles, bounds = asyncio.run(run_policy(args, policy, plan))
            runs.append(run)
            s = Summary.of(run, profiles)
            log.info(
                "%s: goodput %.2f req/s, %d/%d met both, %d violation(s), errors %s",
                *(policy, s.goodput_rps, s.good, s.requests, s.violations, s.errors),
            )
    except KeyboardInterrupt:
        log.warning("interrupted; the server is stopped")
        return 130
    out = args.out or RESULTS_DIR / f"goodput-{now:%Y-%m-%d}.json"
    report(args, runs, profiles, bounds, now, host, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Goodput benchmark: quantroute's per-request routing vs five static policies.

A mixed workload (``exact``, ``balanced`` and ``fast`` requests, each with its own length and
deadline) runs against the demo model ``tiny-llama`` on one simulated device whose memory
shrinks during the run. Six policies are compared, each against a fresh ``quantroute serve``
(so residency state does not carry over), with the same seeded schedule of requests and
deadlines and the same memory schedule:

* **quantroute** -- ``"model": "tiny-llama"`` and the request's ``quality`` tier: the router
  picks the branch per request;
* **always-f16**, **always-q8_0**, **always-q4_k_m** -- every request pinned to that branch;
* **round-robin** -- requests pinned to f16, q8_0, q4_k_m in turn;
* **static-tier** -- each tier pinned to the cheapest branch (smallest file) that meets the
  tier's bound by its profile, read from ``POST /v1/route/explain`` and ``GET /v1/models``
  (for the demo: ``exact`` -> f16, ``balanced`` and ``fast`` -> q4_k_m).

For the pinned policies the tier is the client's bookkeeping only (it is not sent).

**Arrivals are open-loop.** Every request is sent at its Poisson due time by a task of its own,
whatever is still in flight (no client workers, no connection-pool limit), so a slow server
cannot make the client send later and look better; the deadline counts from the due time, and
the send lateness (send - due) is reported.

**Deadlines come from measured speeds.** Before the policies run, a calibration server serves
each branch, idle, a few requests of the longest length, and the script takes each branch's
median time to first token and decode speed. A request's deadline is ``slack x`` the fastest
branch's idle service time for its length (``ttft + (max_tokens - 1) / decode_tps``), with the
slack drawn log-uniformly from ``--slack`` (1 to 4 by default): the tightest requests need an
idle branch, so the deadline binds for some of them whenever a branch is busy. Every request
sends the rest of its deadline as ``x-quantroute-deadline-ms``.

**Out-of-memory comes from the worker.** A simulated device over its budget makes each worker
on it fail new sequences' KV allocation with ``device_out_of_memory`` (docs/telemetry.md), so
a routed request falls back before its first token and a pinned one gets the error.

A request **met its quality bound** iff it was answered (HTTP 200) by a branch that meets its
tier's bounds by the branch's profile (``exact``: the reference only). It **met its deadline**
iff its stream completed (``[DONE]``, no error event, all ``max_tokens`` tokens, no
``finish_reason: deadline``) within its deadline of its due time. **Goodput** is the number of
requests that met both, per second. A **violation** is a 200 answer from a branch that does
not meet the request's tier.

The memory schedule is a list of phases of equal length. Each phase sets the *room for the
model*: the device memory left to the model's branches after other tenants and the safety
margin, i.e. ``total - safety margin - pressure``. The script measures that room once at start
(``free_for_routing + used``, with no pressure) and sets ``PUT /admin/devices/sim:0/pressure``
to ``room0 - target`` at each phase start, so every policy sees the same schedule whatever its
traffic kept loaded. With ``--telemetry-sim-weight-scale 2000`` the branches occupy about 7.1,
3.8 and 2.2 GiB (f16, q8_0, q4_k_m), so the default rooms (20, 12, 7, 5, 3 GiB) go: all three
fit; one must leave; f16 no longer fits at all; q8_0 and q4_k_m no longer fit together; only
q4_k_m fits.

Output: the calibrated speeds; per policy and per phase (by due time) goodput, violations,
mean KLD served and TTFT p99; the goals (per phase: quantroute >= 1.0x the best zero-violation
static policy at a lower mean KLD served; over the run: >= 1.5x always-f16). ``--markdown``
prints the tables for docs/benchmarks.md. JSON goes to ``benchmarks/results/goodput-<date>.json``,
the chart to ``docs/img/bench_goodput.png``, the servers' logs to ``benchmarks/results/logs/``.

Run (CPU-heavy: under the shared lock)::

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_goodput.py --markdown  # ~8 min
    .venv/bin/python benchmarks/bench_goodput.py --duration-s 10 --policies quantroute
    .venv/bin/python benchmarks/bench_goodput.py --replot benchmarks/results/goodput-DATE.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
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
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

import goodput_report as rep
from goodput_report import POLICIES, QUANTROUTE, STATIC_TIER, Bounds, Outcome, Run
from servers import Server, free_port, quantroute_command

log = logging.getLogger("bench_goodput")

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_CHART = ROOT / "docs" / "img" / "bench_goodput.png"
GIB = 1 << 30

MODEL = "tiny-llama"
BRANCHES = ("f16", "q8_0", "q4_k_m")
PINS: dict[str, tuple[str, ...]] = {
    QUANTROUTE: (),
    rep.F16: ("f16",),
    rep.Q8: ("q8_0",),
    rep.Q4: ("q4_k_m",),
    rep.ROUND_ROBIN: BRANCHES,
    STATIC_TIER: (),  # per tier, from the profiles
}
PROMPTS = (
    "def main():\n",
    "Once upon a time",
    "The capital of France is",
    "import numpy as np\n",
    "Q: What is two plus two?\nA:",
)
LOOSE_DEADLINE_MS = 60_000.0  # warm-up and calibration requests


# -- the workload -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the schedule: when it is due (s from the run's start), its shape."""

    index: int
    due_s: float
    tier: str
    prompt: str
    max_tokens: int
    slack: float  # its deadline over the fastest branch's idle service time
    deadline_ms: float = LOOSE_DEADLINE_MS


@dataclass(frozen=True, slots=True)
class Speed:
    """A branch's measured idle speed through the whole server (HTTP, gateway, worker)."""

    branch: str
    ttft_ms: float
    decode_tps: float
    profile_decode_tps: float | None  # what the router's deadline filter reads

    def service_ms(self, max_tokens: int) -> float:
        return self.ttft_ms + 1000.0 * (max_tokens - 1) / self.decode_tps


def schedule(args: argparse.Namespace, speeds: dict[str, Speed]) -> list[Planned]:
    """A seeded Poisson schedule over the run, with deadlines from the measured speeds.

    The same seed gives the same arrivals, tiers, prompts, lengths and slacks whatever the
    speeds; only the deadlines scale with them.
    """
    rng = random.Random(args.seed)
    tiers, weights = zip(*args.mix.items(), strict=True)
    lo, hi = args.slack
    out: list[Planned] = []
    t = rng.expovariate(args.rate)
    while t < args.duration_s:
        tier = rng.choices(tiers, weights)[0]
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.choice(args.max_tokens)
        slack = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        fastest = min((s.service_ms(max_tokens) for s in speeds.values()), default=0.0)
        deadline = max(1.0, round(slack * fastest, 1)) if speeds else LOOSE_DEADLINE_MS
        out.append(Planned(len(out), t, tier, prompt, max_tokens, slack, deadline))
        t += rng.expovariate(args.rate)
    return out


# -- the server ---------------------------------------------------------------

ADMIN_KEY = secrets.token_urlsafe(16)  # the pressure endpoint is an admin one


def make_server(args: argparse.Namespace, name: str) -> Server:
    command = quantroute_command()
    port = free_port()
    argv = [
        command, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--devices", args.devices, "--telemetry-sim-weight-scale", str(args.weight_scale),
        "--telemetry-poll-interval-s", str(args.poll_interval_s),
        "--server-log-level", "warning", "--server-admin-key", ADMIN_KEY,
    ]  # fmt: skip
    return Server(name, argv, port, "/readyz", RESULTS_DIR / "logs" / f"goodput-{name}.log")


def client(server: Server) -> httpx.AsyncClient:
    """No pool limit: a request never waits for a connection (that would be a hidden late send)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=httpx.Timeout(90.0))


async def devices(c: httpx.AsyncClient) -> dict[str, Any]:
    resp = await c.get("/v1/devices")
    resp.raise_for_status()
    body: dict[str, Any] = resp.json()
    return body


async def observed(c: httpx.AsyncClient) -> dict[str, Any]:
    """The router's observed end-to-end speed of each branch (``observed_speed`` in
    ``/v1/models``: what its deadline filter predicts with), ``None`` where it has none."""
    resp = await c.get("/v1/models")
    resp.raise_for_status()
    model = next(m for m in resp.json()["data"] if m["id"] == MODEL)
    return {b["id"]: b.get("observed_speed") for b in model["branches"]}


def loaded(snapshot: dict[str, Any]) -> list[str]:
    return [b for b, v in snapshot["branches"].items() if v.get("ready")]


async def read_model(c: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Bounds]]:
    """The branches' profiles (plus ``reference`` and ``size_bytes``) and every tier's bounds."""
    resp = await c.get("/v1/models")
    resp.raise_for_status()
    model = next(m for m in resp.json()["data"] if m["id"] == MODEL)
    profiles = {
        b["id"]: b["profile"] | {"reference": b["reference"], "size_bytes": b["size_bytes"]}
        for b in model["branches"]
    }
    bounds: dict[str, Bounds] = {}
    for tier in ("exact", "high", "balanced", "fast"):
        body = {"model": MODEL, "prompt": "x", "quality": tier}
        req = (await c.post("/v1/route/explain", json=body)).json()["requirement"]
        bounds[tier] = Bounds(tier == "exact", req["max_kld"], req["min_top1"])
    return profiles, bounds


def target_of(policy: str, planned: Planned, tier_map: dict[str, str]) -> str:
    if policy == STATIC_TIER:
        return tier_map[planned.tier]
    pins = PINS[policy]
    return f"{MODEL}:{pins[planned.index % len(pins)]}" if pins else MODEL


async def send(c: httpx.AsyncClient, planned: Planned, target: str, t0: float) -> Outcome:
    """Stream one completion; the deadline header carries what is left of its deadline."""
    out = Outcome(
        planned.index, planned.tier, target, planned.due_s, planned.deadline_ms,
        planned.max_tokens, sent_s=time.perf_counter() - t0,
    )  # fmt: skip
    body: dict[str, Any] = {
        "model": target,
        "prompt": planned.prompt,
        "max_tokens": planned.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target == MODEL:
        body["quality"] = planned.tier
    left_ms = planned.deadline_ms - out.late_s * 1000.0
    headers = {"x-quantroute-deadline-ms": str(max(1, math.floor(left_ms)))}
    try:
        async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
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
                        out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if chunk.get("usage"):
                        out.tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    out.done_s = time.perf_counter() - t0
    return out


# -- calibration --------------------------------------------------------------


async def calibrate(args: argparse.Namespace) -> dict[str, Speed]:
    """Each branch's median idle TTFT and decode speed, one request at a time, all loaded.

    The branches take turns, round after round, so a change in the machine's load during
    the calibration shifts them all alike rather than the branch measured last.
    """
    server = make_server(args, "calibration")
    n = max(args.max_tokens)
    ttfts: dict[str, list[float]] = {b: [] for b in BRANCHES}
    rates: dict[str, list[float]] = {b: [] for b in BRANCHES}
    try:
        server.start()
        await asyncio.to_thread(server.wait_ready, args.start_timeout_s)
        async with client(server) as c:
            profiles, _ = await read_model(c)
            for i in range(args.calibration_requests + 1):  # round 0 warms up
                for branch in BRANCHES:
                    p = Planned(-1, 0.0, "fast", PROMPTS[i % len(PROMPTS)], n, 1.0)
                    o = await send(c, p, f"{MODEL}:{branch}", time.perf_counter())
                    if o.status != 200 or o.ttft_s is None or o.tokens < 2:
                        raise RuntimeError(f"calibration request to {branch} failed: {o}")
                    if i:
                        ttfts[branch].append(o.ttft_s * 1000.0)
                        rates[branch].append((o.tokens - 1) / (o.done_s - o.sent_s - o.ttft_s))
    finally:
        server.stop()
    speeds: dict[str, Speed] = {}
    for branch in BRANCHES:
        profile_tps = profiles.get(f"{MODEL}:{branch}", {}).get("decode_tps")
        s = speeds[branch] = Speed(
            branch, statistics.median(ttfts[branch]), statistics.median(rates[branch]), profile_tps
        )
        log.info(
            "calibration %-7s TTFT %.1f ms, decode %.0f tok/s (profile: %s tok/s); "
            "%d tokens in %.1f ms",
            *(branch, s.ttft_ms, s.decode_tps, rep.fmt(profile_tps, ".0f"), n, s.service_ms(n)),
        )
    return speeds


# -- one policy's run ---------------------------------------------------------


async def pressure_schedule(
    c: httpx.AsyncClient, args: argparse.Namespace, room0: int, t0: float, run: Run
) -> None:
    """Set the pressure at every phase start; note what is loaded just before the next."""
    phase_s = args.duration_s / len(args.phases_gib)
    for i, target in enumerate(args.phases_gib):
        await asyncio.sleep(max(0.0, t0 + i * phase_s - time.perf_counter()))
        pressure = max(0, room0 - int(target * GIB))
        resp = await c.put(
            "/admin/devices/sim:0/pressure",
            json={"bytes": pressure},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        resp.raise_for_status()
        await asyncio.sleep(max(0.0, t0 + (i + 1) * phase_s - 0.3 - time.perf_counter()))
        snap = await devices(c)
        mem = snap["data"][0]["memory"]
        run.phases.append(
            {
                "room_gib": target,
                "pressure_bytes": pressure,
                "free_for_routing_gib": mem["free_for_routing_bytes"] / GIB,
                "loaded_at_end": loaded(snap),
                "observed_at_end": await observed(c),
            }
        )
        log.info(
            "  %-13s phase %d: room %4.1f GiB, free-for-routing %5.2f GiB, loaded %s",
            *(run.policy, i + 1, target, mem["free_for_routing_bytes"] / GIB),
            ", ".join(b.split(":")[1] for b in loaded(snap)) or "nothing",
        )


async def open_loop(
    c: httpx.AsyncClient, policy: str, plan: list[Planned], tier_map: dict[str, str], t0: float
) -> list[Outcome]:
    """Start every request at its due time in a task of its own, whatever is in flight."""
    tasks: list[asyncio.Task[Outcome]] = []
    for p in plan:
        wait = t0 + p.due_s - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(send(c, p, target_of(policy, p, tier_map), t0)))
    return list(await asyncio.gather(*tasks))


async def run_policy(
    args: argparse.Namespace, policy: str, plan: list[Planned]
) -> tuple[Run, dict[str, Any], dict[str, Bounds]]:
    server = make_server(args, policy)
    run = Run(policy)
    try:
        server.start()
        await asyncio.to_thread(server.wait_ready, args.start_timeout_s)
        async with client(server) as c:
            profiles, bounds = await read_model(c)
            tier_map = rep.static_tier_map(profiles, bounds)
            # Warm-up, the same for every policy: one request per branch and one routed.
            for target in [f"{MODEL}:{b}" for b in BRANCHES] + [MODEL]:
                await send(c, Planned(-1, 0.0, "fast", PROMPTS[0], 16, 1.0), target, 0.0)
            await asyncio.sleep(2 * args.poll_interval_s)
            snap = await devices(c)
            mem = snap["data"][0]["memory"]
            room0 = mem["free_for_routing_bytes"] + mem["used_bytes"]  # no pressure yet
            log.info(
                "%s: server ready on port %d; room for the model %.1f GiB, loaded %s",
                *(policy, server.port, room0 / GIB, ", ".join(loaded(snap))),
            )
            t0 = time.perf_counter()
            outcomes, _ = await asyncio.gather(
                open_loop(c, policy, plan, tier_map, t0),
                pressure_schedule(c, args, room0, t0, run),
            )
            run.outcomes = outcomes
            run.wall_s = max(args.duration_s, time.perf_counter() - t0)
    finally:
        server.stop()  # not in a thread: a cancelled task (Ctrl-C) must still get here to the end
    for o in run.outcomes:
        o.judge(profiles, bounds)
    run.outcomes.sort(key=lambda o: o.index)
    return run, profiles, bounds


# -- reporting ----------------------------------------------------------------


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


def speed_rows(speeds: dict[str, Speed], lengths: list[int]) -> list[list[str]]:
    return [
        [
            s.branch,
            f"{s.ttft_ms:.1f}",
            f"{s.decode_tps:.0f}",
            rep.fmt(s.profile_decode_tps, ".0f"),
            " / ".join(f"{s.service_ms(n):.0f}" for n in lengths),
        ]
        for s in speeds.values()
    ]


def report(
    args: argparse.Namespace,
    runs: list[Run],
    speeds: dict[str, Speed],
    profiles: dict[str, Any],
    bounds: dict[str, Bounds],
    now: dt.datetime,
    host: dict[str, Any],
    out: Path | None,
) -> None:
    """Print the tables and the goals; write the JSON (unless ``out`` is None) and chart."""
    rooms = args.phases_gib
    overall, phases = rep.summarize(runs, profiles, args.duration_s, len(rooms))
    goals = [rep.phase_goal(ph) for ph in phases]
    ratio = rep.vs_f16(overall)
    qr = next((s for s in overall if s.policy == QUANTROUTE), None)
    f16_met = ratio is not None and ratio >= rep.GOAL_VS_F16 and bool(qr and not qr.violations)
    lengths = sorted(set(args.max_tokens))
    mix = ", ".join(f"{t} {w:g}%" for t, w in args.mix.items())
    n_requests = len(runs[0].outcomes) if runs else 0
    tier_map = rep.static_tier_map(profiles, bounds) if profiles else {}
    settings = (
        f"{MODEL} on {args.devices} (weight scale {args.weight_scale:g}); {n_requests} requests "
        f"in {args.duration_s:g} s per policy (open-loop Poisson, {args.rate:g}/s, seed "
        f"{args.seed}; {mix}); max_tokens {'/'.join(map(str, lengths))}; deadline = slack "
        f"{args.slack[0]:g}-{args.slack[1]:g} (log-uniform) x the fastest branch's measured "
        f"idle service time; rooms {' -> '.join(f'{r:g}' for r in rooms)} GiB; static-tier: "
        + ", ".join(f"{t} -> {b.split(':')[-1]}" for t, b in tier_map.items() if t in args.mix)
    )
    where = f"{now:%Y-%m-%d}, {host['cpu']} ({host['cpus']} CPUs), {host['platform']}"
    md = args.markdown
    labels = [f"{r:g} GiB" for r in rooms]
    sections = [
        f"_Measured on {where}; {settings}._" if md else settings,
        rep.table(
            (
                "Branch",
                "TTFT (ms)",
                "Decode (tok/s)",
                "Profile decode_tps",
                "Service (ms), " + " / ".join(f"{n}" for n in lengths) + " tokens",
            ),
            speed_rows(speeds, lengths),
            markdown=md,
        ),
        rep.table(
            rep.OVERALL_COLUMNS, rep.overall_rows(overall), markdown=md, align=rep.OVERALL_ALIGN
        ),
    ]
    for metric, title, spec in rep.METRICS:
        cells = rep.phase_rows(metric, spec, phases, overall)
        sections.append(
            (f"**{title}** by phase:" if md else f"{title} by phase:")
            + "\n\n"
            + rep.table(("Policy", *labels, "whole run"), cells, markdown=md)
        )
    sections.append(rep.table(rep.GOAL_COLUMNS, rep.goal_rows(goals, rooms), markdown=md))
    lines = [
        f"goodput quantroute / always-f16 over the run: {rep.fmt(ratio, '.2f')}x "
        f"(goal >= {rep.GOAL_VS_F16}x with zero violations: {'met' if f16_met else 'NOT met'})",
        "per phase, >= 1.0x the best zero-violation static policy at a lower mean KLD served: "
        f"{sum(bool(g and g.met) for g in goals)} of {len(goals)} phases",
    ]
    sections.append("\n".join(f"- {line}" if md else line for line in lines))
    loaded_rows = [
        [r.policy, *("+".join(b.split(":")[1] for b in ph["loaded_at_end"]) or "-"
                     for ph in r.phases)]
        for r in runs
    ]  # fmt: skip
    sections.append(
        "Loaded at the end of each phase:\n\n"
        + rep.table(("Policy", *labels), loaded_rows, markdown=md)
    )
    qr_run = next((r for r in runs if r.policy == QUANTROUTE), None)
    if qr_run is not None and any("observed_at_end" in ph for ph in qr_run.phases):
        seen_rows = [
            [
                b.split(":")[1],
                *(
                    "-"
                    if not (o := ph.get("observed_at_end", {}).get(b))
                    else f"{o['ttft_ms']:.1f} / {o['decode_tps'] or 0:.0f}"
                    for ph in qr_run.phases
                ),
            ]
            for b in sorted(qr_run.phases[0].get("observed_at_end", {}))
        ]
        sections.append(
            "The router's observed speed at the end of each phase (quantroute's run; TTFT ms / "
            "decode tok/s, what its deadline filter predicts with):\n\n"
            + rep.table(("Branch", *labels), seen_rows, markdown=md)
        )
    print("\n\n" + "\n\n".join(sections) + "\n")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "date": now.isoformat(timespec="seconds"),
            "machine": host,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "speeds": {k: asdict(v) for k, v in speeds.items()},
            "profiles": profiles,
            "bounds": {k: asdict(v) for k, v in bounds.items()},
            "ratio_vs_f16": ratio,
            "phase_goals": [asdict(g) if g else None for g in goals],
            "summaries": [asdict(s) for s in overall],
            "phase_summaries": [[asdict(s) for s in ph] for ph in phases],
            "runs": [
                {
                    "policy": r.policy,
                    "wall_s": r.wall_s,
                    "phases": r.phases,
                    "outcomes": [asdict(o) for o in r.outcomes],
                }
                for r in runs
            ],
        }
        out.write_text(json.dumps(body, indent=2) + "\n")
        log.info("wrote %s", out)
    if not args.no_chart and runs:
        rep.save_chart(overall, phases, rooms, f"{settings}; {where}", args.chart)
        log.info("wrote %s", args.chart)


def replot(args: argparse.Namespace) -> None:
    """Report again from a saved JSON file, with this invocation's output flags."""
    saved = json.loads(args.replot.read_text())
    for key, value in saved["settings"].items():
        if key not in ("markdown", "chart", "no_chart", "replot", "out"):
            setattr(args, key, value)
    runs = [
        Run(r["policy"], r["wall_s"], [Outcome(**o) for o in r["outcomes"]], r["phases"])
        for r in saved["runs"]
    ]
    speeds = {k: Speed(**v) for k, v in saved["speeds"].items()}
    bounds = {k: Bounds(**v) for k, v in saved["bounds"].items()}
    now = dt.datetime.fromisoformat(saved["date"])
    report(args, runs, speeds, saved["profiles"], bounds, now, saved["machine"], None)


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
    p.add_argument("--duration-s", type=float, default=60.0, help="per policy")
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--mix", type=parse_mix, default="exact=20,balanced=40,fast=40")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[32, 64, 128],
                   help="lengths, drawn uniformly per request")  # fmt: skip
    p.add_argument("--slack", type=float, nargs=2, default=[1.0, 4.0], metavar=("LO", "HI"),
                   help="deadline / fastest idle service time, drawn log-uniformly")  # fmt: skip
    p.add_argument("--calibration-requests", type=int, default=8, help="per branch")
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
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/...)")
    p.add_argument("--chart", type=Path, default=DEFAULT_CHART)
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--replot", type=Path, help="report again from a saved JSON; no servers")
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.rate <= 0 or min(args.max_tokens) < 2:
        p.error("--duration-s and --rate must be > 0, --max-tokens >= 2")
    if not 0 < args.slack[0] <= args.slack[1]:
        p.error("--slack needs 0 < LO <= HI")
    if isinstance(args.mix, str):
        args.mix = parse_mix(args.mix)
    return args


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through the finally that stops the server


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
    runs: list[Run] = []
    profiles: dict[str, Any] = {}
    bounds: dict[str, Bounds] = {}
    try:
        speeds = asyncio.run(calibrate(args))
        plan = schedule(args, speeds)
        deadlines = sorted(p.deadline_ms for p in plan)
        log.info(
            "%d requests over %.0f s per policy (%s); deadlines %.0f-%.0f ms (median %.0f)",
            *(len(plan), args.duration_s, dict(Counter(p.tier for p in plan))),
            *(deadlines[0], deadlines[-1], statistics.median(deadlines)),
        )
        for policy in args.policies:
            run, profiles, bounds = asyncio.run(run_policy(args, policy, plan))
            runs.append(run)
            s = rep.Summary.of(policy, run.outcomes, args.duration_s, profiles)
            log.info(
                "%s: goodput %.2f req/s, %d/%d met both, %d violation(s), errors %s",
                *(policy, s.goodput_rps, s.good, s.requests, s.violations, s.errors),
            )
    except KeyboardInterrupt:
        log.warning("interrupted; the server is stopped")
        return 130
    out = args.out or RESULTS_DIR / f"goodput-{now:%Y-%m-%d}.json"
    report(args, runs, speeds, profiles, bounds, now, host, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

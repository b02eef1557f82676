"""A fleet: one, two and four gateways in front of the same engine (issue 34 §5).

The engine: one ``llama-server`` (``scripts/llama_server_build.sh``'s build, one thread) on
the demo model's q8_0 file, started once (``--engines``: one server per precision, the
first the reference; three servers on one core time-slice each other, see
docs/benchmarks.md). Every gateway is ``quantroute serve`` over a repository whose
``tiny-llama`` has the servers as remote branches (``engine: openai``), with a tenants file
(one tenant, per-minute limits far above the run's, so the limit path runs on every
request); the requests rotate the tiers balanced, high, exact. One etcd and one
redis-server serve every gateway that uses them; the tenant is in etcd too.

1. **The cluster paths' added latency** (run first): three gateways up at once, one per
   configuration -- cluster *off* (tenants file, local limits), *etcd* (drains, traffic
   rules, tenants read from etcd) and *etcd+redis* (also every stream copied to Redis and
   the tenant's limits counted there: one ``EVALSHA`` before each request's first token) --
   and one client sending sequential requests, one to each in a rotating order, the same
   request to all three: the paired per-request difference to *off*, median and p99; each
   gateway's CPU idle and per request. (``bench_redis.py`` measures the Redis paths
   in-process: the ``EVALSHA`` ~0.4 ms.)
2. **The bound**: ``--bound-factor`` (4) times the etcd+redis gateway's unloaded p99 from
   part 1, of TTFT and of end-to-end time.
3. **The fleets** (``--fleets``: 1, 2, 4 gateways, etcd+redis; ``1-off``: one gateway with
   the cluster off), every fleet's gateways up at once (eight processes; those not serving
   idle): an open-loop client (Poisson arrivals, seeded: every fleet gets the same arrival
   times at a rate) sends the requests round-robin over one fleet's gateways at a time, at
   a rate stepped up by ``--step-factor`` from ``--start-rate``, each rate offered to every
   fleet in turn (who goes first rotating: the machine's drift falls on all alike), a step
   ``--warmup-s`` and then at least ``--step-s`` and ``--step-requests`` measured, until
   ``--patience`` steps in a row of a fleet break the bound. Reported: the highest rate
   within the bound (every request answered, p99 TTFT and p99 end-to-end within it) below
   those, p50/p99 there, each gateway's CPU; and, at each rate, a fleet's p99s and CPU per
   request over one gateway's (their median over the rates).

Latencies run from the request's send (the client's lateness against the arrival schedule
is reported apart, ``lag``); a stream without exactly ``--max-tokens`` tokens (end of
sequence banned) is an error. CPUs (``--no-pin`` for none): the engine, etcd and Redis on
the first core, the gateways and this client on the other, so more gateways add no CPU:
what they cost in coordination shows, and what the fleet holds.

Run::

    .venv/bin/python benchmarks/bench_fleet.py                          # ~10 minutes
    .venv/bin/python benchmarks/bench_fleet.py --fleets 1 2 --step-s 2 --warmup-s 1 \\
        --path-requests 30 --start-rate 20 --patience 1 --no-chart          # a smoke run
    .venv/bin/python benchmarks/bench_fleet.py --replot benchmarks/results/fleet-....json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fleet_parts as parts  # noqa: E402
from bench_litellm import llama_server_binary, machine  # noqa: E402
from quantroute.demo.vocab import EOS_ID  # noqa: E402
from stats import fmt, median, p99, percentile  # noqa: E402

log = logging.getLogger("bench_fleet")

RESULTS_DIR = ROOT / "benchmarks" / "results"
CLUSTER = "fleet"
PROMPTS = ("def read_config(path):", "import os\nimport sys\n\n\nclass Cache:",
           "for line in open(path):")  # fmt: skip
TIERS = ("balanced", "high", "exact")
LIMITS = (10**7, 10**12)  # the tenant's requests and tokens per minute: never reached
SAME_RATE = ("ttft_p99_ms", "e2e_p99_ms", "gateway_cpu_ms_per_request")  # fleet / 1 gateway
COLORS = {"1-off": "#7f7f7f", "1": "#1f77b4", "2": "#ff7f0e", "4": "#2ca02c"}


# -- records (pure) ---------------------------------------------------------------------


def ms(values: Sequence[float], q: float) -> float | None:
    got = percentile(values, q)
    return None if got is None else got * 1e3


@dataclass(slots=True)
class Step:
    """One offered rate on one fleet: the requests due in its measured window, and each
    process's CPU seconds over that window."""

    fleet: str
    rate: float
    window_s: float
    samples: list[parts.Sample]
    cpu_s: dict[str, float]  # gateway-0.., engines, etcd, redis, client

    def values(self, metric: str) -> list[float]:
        got = (getattr(s, metric) for s in self.samples if s.error is None)
        return [v for v in got if v is not None]

    def record(self, bound_ms: dict[str, float]) -> dict[str, Any]:
        """The step as a JSON record, its verdict against ``bound_ms`` (ttft, e2e)."""
        ok, ttft = self.values("e2e_s"), self.values("ttft_s")
        errors = [s.error for s in self.samples if s.error is not None]
        gateways = {k: v for k, v in self.cpu_s.items() if k.startswith("gateway")}
        rec: dict[str, Any] = {
            "fleet": self.fleet, "rate": self.rate, "window_s": self.window_s,
            "requests": len(self.samples), "errors": len(errors),
            "first_error": next(iter(errors), None), "done_per_s": len(ok) / self.window_s,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "e2e_p50_ms": ms(ok, 50), "e2e_p99_ms": ms(ok, 99),
            "lag_p99_ms": ms([s.lag_s for s in self.samples], 99),
            "cpu_pct": {k: 100 * v / self.window_s for k, v in self.cpu_s.items()},
            "gateway_cpu_ms_per_request": 1e3 * sum(gateways.values()) / len(ok) if ok else None,
            "branches": dict(Counter(s.branch or "-" for s in self.samples)),
        }  # fmt: skip
        rec["within_bound"] = within(rec, bound_ms)
        return rec


def within(rec: dict[str, Any], bound_ms: dict[str, float]) -> bool:
    """Every request answered, p99 TTFT and p99 end-to-end within ``bound_ms``."""
    if rec["errors"] or rec["ttft_p99_ms"] is None or rec["e2e_p99_ms"] is None:
        return False
    return bool(rec["ttft_p99_ms"] <= bound_ms["ttft"] and rec["e2e_p99_ms"] <= bound_ms["e2e"])


def held(steps: Sequence[dict[str, Any]], bound_ms: dict[str, float], patience: int,
         ) -> dict[str, Any] | None:  # fmt: skip
    """The step of the highest rate within ``bound_ms`` below the first ``patience`` steps
    in a row over it (the sweep's own stopping rule: one noisy step does not end it)."""
    best, misses = None, 0
    for step in sorted(steps, key=lambda s: s["rate"]):
        if within(step, bound_ms):
            best, misses = step, 0
        elif (misses := misses + 1) >= patience:
            break
    return best


def paired(base: Sequence[parts.Sample], other: Sequence[parts.Sample], metric: str) -> list[float]:
    """Per request, ``other``'s time minus ``base``'s (ms), where both were answered."""
    out = []
    for a, b in zip(base, other, strict=True):
        x, y = getattr(a, metric), getattr(b, metric)
        if a.error is None and b.error is None and x is not None and y is not None:
            out.append((y - x) * 1e3)
    return out


def paths_summary(got: dict[str, list[parts.Sample]], cpu_s: dict[str, float],
                  idle_pct: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """Per configuration: p50/p99 of TTFT and end-to-end, its gateway's CPU while idle (%
    of a core) and per request (ms, what it spent idle over as long taken off), and (but
    *off*) the paired difference to *off*: median and p99."""
    out: dict[str, Any] = {}
    for config, samples in got.items():
        ok = [s for s in samples if s.error is None]
        row: dict[str, Any] = {"requests": len(samples), "errors": len(samples) - len(ok)}
        for m in ("ttft", "e2e"):
            values = [getattr(s, f"{m}_s") for s in ok]
            row[f"{m}_p50_ms"], row[f"{m}_p99_ms"] = ms(values, 50), ms(values, 99)
            if config != parts.OFF:
                diff = paired(got[parts.OFF], samples, f"{m}_s")
                row[f"added_{m}_median_ms"], row[f"added_{m}_p99_ms"] = median(diff), p99(diff)
        row["gateway_idle_cpu_pct"] = idle_pct[config]
        row["gateway_cpu_ms_per_request"] = 1e3 * cpu_s[config] / len(samples) if samples else None
        out[config] = row
    return out


# -- the load ---------------------------------------------------------------------------


async def offer(client: parts.Client, meter: parts.Meter, fleet: str, rate: float,
                bodies: Sequence[bytes], args: argparse.Namespace) -> Step:  # fmt: skip
    """``rate`` requests/s for ``warmup_s + step_s``, round-robin over the client's gateways;
    the requests due after the warm-up are the step's."""
    n = len(client.ports)
    span = max(args.step_s, args.step_requests / rate)
    dues = parts.arrivals(rate, args.warmup_s + span, args.seed + round(rate * 1000))
    t0 = time.perf_counter() + 0.05
    marks: list[dict[str, float]] = []

    async def mark(at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        marks.append(meter.read())

    marker = asyncio.gather(mark(args.warmup_s), mark(args.warmup_s + span))
    tasks = []
    for k, due in enumerate(dues):
        if (delay := t0 + due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        body = bodies[(k // n) % len(bodies)]  # each gateway gets every tier in turn
        lag = time.perf_counter() - t0 - due
        tasks.append(asyncio.create_task(client.send(k % n, body, lag)))
    await marker
    samples = await asyncio.gather(*tasks)
    counted = [s for s, due in zip(samples, dues, strict=True) if due >= args.warmup_s]
    return Step(fleet, rate, span, counted, parts.Meter.since(marks[0], marks[1]))


async def sweep(clients: dict[str, parts.Client], meters: dict[str, parts.Meter],
                bodies: Sequence[bytes], bound_ms: dict[str, float], args: argparse.Namespace,
                ) -> list[dict[str, Any]]:  # fmt: skip
    """Step the rate up, each rate offered to every fleet in turn (who goes first rotating,
    so the machine's drift falls on all alike), until ``patience`` steps in a row of a
    fleet break the bound; that fleet then stops."""
    records: list[dict[str, Any]] = []
    live, misses, rate = list(clients), dict.fromkeys(clients, 0), args.start_rate
    while live and rate <= args.max_rate:
        shift = len(records) % len(live)
        for fleet in live[shift:] + live[:shift]:
            await meters[fleet].settle()
            step = await offer(clients[fleet], meters[fleet], fleet, rate, bodies, args)
            records.append(rec := step.record(bound_ms))
            misses[fleet] = 0 if rec["within_bound"] else misses[fleet] + 1
            log.info("%s", progress(rec))
        live = [f for f in live if misses[f] < args.patience]
        rate *= args.step_factor
    return records


def progress(rec: dict[str, Any]) -> str:
    cpu = rec["cpu_pct"]
    gws = "+".join(f"{v:.0f}" for k, v in cpu.items() if k.startswith("gateway"))
    verdict = "within bound" if rec["within_bound"] else "OVER"
    return (
        f"fleet {rec['fleet']:>5}: {rec['rate']:6.1f}/s offered, {rec['done_per_s']:6.1f}/s "
        f"answered, {rec['errors']} errors; TTFT p50/p99 {fmt(rec['ttft_p50_ms'])}/"
        f"{fmt(rec['ttft_p99_ms'])} ms, e2e {fmt(rec['e2e_p50_ms'])}/{fmt(rec['e2e_p99_ms'])}; "
        f"CPU % gateways {gws}, engines {cpu['engines']:.0f}, client {cpu['client']:.0f}; "
        f"lag p99 {fmt(rec['lag_p99_ms'])} ms: {verdict}"
    )


async def cluster_paths(client: parts.Client, meter: parts.Meter, bodies: Sequence[bytes],
                        args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Sequential requests, one to each configuration's gateway in a rotating order, the
    same body to all three; what each one's gateway spent per request."""
    got: dict[str, list[parts.Sample]] = {c: [] for c in parts.CONFIGS}
    for i in range(args.path_warmup):
        for g in range(len(parts.CONFIGS)):
            await client.send(g, bodies[i % len(bodies)])
    await meter.settle()
    before = meter.read()
    await asyncio.sleep(args.idle_s)  # what each gateway spends idle: probes, heartbeats
    idle = parts.Meter.since(before, meter.read())
    before, start = meter.read(), time.perf_counter()
    for i in range(args.path_requests):
        shift = (i // len(bodies)) % len(parts.CONFIGS)  # every order with every body
        for g in [*range(shift, len(parts.CONFIGS)), *range(shift)]:
            got[parts.CONFIGS[g]].append(await client.send(g, bodies[i % len(bodies)]))
        if (i + 1) % max(1, args.path_requests // 4) == 0:
            log.info("cluster paths: %d of %d rounds", i + 1, args.path_requests)
    used, took_s = parts.Meter.since(before, meter.read()), time.perf_counter() - start
    rates = {c: idle[f"gateway-{c}"] / args.idle_s for c in parts.CONFIGS}
    cpu = {c: used[f"gateway-{c}"] - rates[c] * took_s for c in parts.CONFIGS}
    samples = {c: [[s.ttft_s, s.e2e_s, s.error] for s in v] for c, v in got.items()}
    idle_pct = {c: 100 * r for c, r in rates.items()}
    return {"summary": paths_summary(got, cpu, idle_pct), "samples": samples}


# -- the run ----------------------------------------------------------------------------


def fleet_shape(fleet: str) -> tuple[int, str]:
    """``"2"``: two gateways with etcd and Redis; ``"1-off"``: one with the cluster off."""
    count, _, off = fleet.partition("-")
    return int(count), parts.OFF if off == "off" else parts.REDIS


async def measure(
    fleet: parts.Backends, args: argparse.Namespace, bodies: list[bytes]
) -> dict[str, Any]:
    """Part 1 (the cluster paths, and from them the bound), then each fleet's sweep."""
    names = [f"gateway-{c}" for c in parts.CONFIGS]
    try:
        gateways = await asyncio.to_thread(fleet.start_gateways, parts.CONFIGS, names)
        client = parts.Client([g.port for g in gateways], args.max_tokens)
        paths = await cluster_paths(client, fleet.meter(), bodies, args)
        client.close()
        redis = {"paths": [parts.redis_status(gateways[parts.CONFIGS.index(parts.REDIS)])]}
    finally:
        await asyncio.to_thread(fleet.stop_gateways)
    row = paths["summary"][parts.REDIS]
    unloaded = {m: row[f"{m}_p99_ms"] for m in ("ttft", "e2e")}
    bound = {m: args.bound_factor * v for m, v in unloaded.items()}
    log.info("cluster paths:\n%s", paths_table(paths["summary"]))
    log.info("bound: p99 TTFT <= %.1f ms, p99 end-to-end <= %.1f ms", bound["ttft"], bound["e2e"])
    shapes = {shape: fleet_shape(shape) for shape in args.fleets}
    names = [f"gateway{i}@{shape}" for shape, (n, _) in shapes.items() for i in range(n)]
    configs = [config for n, config in shapes.values() for _ in range(n)]
    try:
        every = await asyncio.to_thread(fleet.start_gateways, configs, names)
        mine = {s: [g for g in every if g.name.endswith(f"@{s}")] for s in shapes}
        clients = {s: parts.Client([g.port for g in gs], args.max_tokens) for s, gs in mine.items()}
        for client in clients.values():  # warm: pools, connections, caches
            for i in range(10 * len(client.ports)):
                await client.send(i % len(client.ports), bodies[i % len(bodies)])
        meters = {s: fleet.meter(gs) for s, gs in mine.items()}
        steps = await sweep(clients, meters, bodies, bound, args)
        for shape, client in clients.items():
            client.close()
            redis[shape] = [parts.redis_status(g) for g in mine[shape]]
    finally:
        await asyncio.to_thread(fleet.stop_gateways)
    return {"paths": paths, "unloaded_p99_ms": unloaded, "bound_ms": bound, "steps": steps,
            "redis_status": redis}  # fmt: skip


def summarize(fleets: Sequence[str], steps: Sequence[dict[str, Any]], bound_ms: dict[str, float],
              patience: int) -> dict[str, Any]:  # fmt: skip
    """Per fleet: the step it held within ``bound_ms`` (or None), the rates over the bound
    below it, the next step, its held rate over one gateway's, and, at each rate both ran,
    its p99s and CPU per request over one gateway's: the median of those ratios."""
    out: dict[str, Any] = {}
    by_rate = {(s["fleet"], s["rate"]): s for s in steps}
    for fleet in fleets:
        mine = sorted((s for s in steps if s["fleet"] == fleet), key=lambda s: s["rate"])
        best = held(mine, bound_ms, patience)
        top = best["rate"] if best else 0.0
        row: dict[str, Any] = {
            "held": best,
            "over_below": [s["rate"] for s in mine if s["rate"] < top and not within(s, bound_ms)],
            "next": next((s for s in mine if s["rate"] > top), None),
        }  # fmt: skip
        for key in SAME_RATE:
            ones = [(s[key], by_rate.get(("1", s["rate"]), {}).get(key)) for s in mine]
            ratios = [x / one for x, one in ones if x and one]
            row[f"{key}_vs_one"] = median(ratios)
            row["rates_vs_one"] = len(ratios)
        out[fleet] = row
    base = out.get("1") or {}
    for row in out.values():
        rate, one = (row["held"] or {}).get("rate"), (base.get("held") or {}).get("rate")
        row["vs_one"] = rate / one if rate and one else None
    return out


# -- reporting --------------------------------------------------------------------------


def fleets_table(summary: dict[str, Any]) -> str:
    head = (
        "| Gateways | Held (req/s) | / 1 gateway | There: TTFT p50 / p99 (ms) | End-to-end p50 / "
        "p99 (ms) | Each gateway's CPU (% of a core) | Gateways' CPU per request (ms) | Over "
        "the bound below it; the next step | At the same rate / 1 gateway (median over rates): "
        "p99 TTFT, p99 e2e, CPU per request |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- | ---: |"
    )
    rows = []
    for fleet, row in summary.items():
        h, nxt = row["held"] or {}, row["next"]
        cpu = " + ".join(
            f"{v:.0f}" for k, v in h.get("cpu_pct", {}).items() if k.startswith("gateway")
        )
        below = ", ".join(f"{r:.1f}" for r in row["over_below"]) or "none"
        after = "-" if nxt is None else f"{nxt['rate']:.1f}/s: " + (
            f"{nxt['errors']} errors" if nxt["errors"] else
            f"p99 TTFT {fmt(nxt['ttft_p99_ms'], 0)}, e2e {fmt(nxt['e2e_p99_ms'], 0)}"
        )  # fmt: skip
        same = ", ".join(fmt(row[f"{k}_vs_one"], 2) for k in SAME_RATE)
        rows.append(
            f"| {label(fleet)} | {fmt(h.get('rate'))} | {fmt(row['vs_one'], 2)} | "
            f"{fmt(h.get('ttft_p50_ms'))} / {fmt(h.get('ttft_p99_ms'))} | "
            f"{fmt(h.get('e2e_p50_ms'))} / {fmt(h.get('e2e_p99_ms'))} | {cpu or '-'} | "
            f"{fmt(h.get('gateway_cpu_ms_per_request'), 1)} | {below}; {after} | "
            f"{same} ({row['rates_vs_one']} rates) |"
        )
    return head + "\n" + "\n".join(rows)


def paths_table(summary: dict[str, Any]) -> str:
    head = (
        "| Cluster paths | TTFT p50 / p99 (ms) | End-to-end p50 / p99 (ms) | Added TTFT, paired: "
        "median / p99 (ms) | Added end-to-end, paired: median / p99 (ms) | Gateway CPU: idle (% "
        "of a core), per request (ms) |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = []
    for config, r in summary.items():
        added = [f"{fmt(r.get(f'added_{m}_median_ms'), 2)} / {fmt(r.get(f'added_{m}_p99_ms'), 2)}"
                 if config != parts.OFF else "-" for m in ("ttft", "e2e")]  # fmt: skip
        rows.append(
            f"| {config} | {fmt(r['ttft_p50_ms'], 2)} / {fmt(r['ttft_p99_ms'], 2)} | "
            f"{fmt(r['e2e_p50_ms'], 2)} / {fmt(r['e2e_p99_ms'], 2)} | {added[0]} | {added[1]} | "
            f"{fmt(r['gateway_idle_cpu_pct'], 1)}, {fmt(r['gateway_cpu_ms_per_request'], 2)} |"
        )
    return head + "\n" + "\n".join(rows)


def label(fleet: str) -> str:
    count, config = fleet_shape(fleet)
    return f"{count}, {config}"


def save_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    bound = report["bound_ms"]
    for fleet in report["settings"]["fleets"]:
        steps = sorted((s for s in report["steps"] if s["fleet"] == fleet), key=lambda s: s["rate"])
        rates = [s["rate"] for s in steps]
        color = COLORS.get(fleet)
        for ax, key in ((axes[0], "e2e_p99_ms"), (axes[1], "ttft_p99_ms")):
            ax.plot(
                rates, [s[key] or math.nan for s in steps], "-", color=color, label=label(fleet)
            )
            for within, face in ((True, color), (False, "white")):
                pick = [s for s in steps if s["within_bound"] is within]
                ax.scatter([s["rate"] for s in pick], [s[key] or math.nan for s in pick], s=16,
                           facecolors=face, edgecolors=color, zorder=3)  # fmt: skip
        cpu = [sum(v for k, v in s["cpu_pct"].items() if k.startswith("gateway")) for s in steps]
        axes[2].plot(rates, cpu, "o-", color=color, ms=3, label=label(fleet))
    for ax, key, title in (
        (axes[0], "e2e", "p99 end-to-end (ms)"),
        (axes[1], "ttft", "p99 TTFT (ms)"),
    ):
        ax.axhline(bound[key], color="#d62728", ls="--", lw=0.8, label="bound")
        ax.set_yscale("log")
        ax.set_title(f"{title} by offered rate (hollow: over the bound)", fontsize=9)
        ax.set_xlabel("requests/s offered", fontsize=8)
        ax.legend(fontsize=7)
    axes[2].set_title("The gateways' CPU together (% of one core)", fontsize=9)
    axes[2].set_xlabel("requests/s offered", fontsize=8)
    axes[2].axhline(100, color="#444", lw=0.6)
    axes[2].legend(fontsize=7)
    paths = report["paths"]["summary"]
    configs = [c for c in paths if c != parts.OFF]
    xs = range(len(configs))
    for j, (m, q, alpha) in enumerate((("ttft", "median", 0.45), ("ttft", "p99", 1.0),
                                        ("e2e", "median", 0.45), ("e2e", "p99", 1.0))):  # fmt: skip
        vals = [paths[c][f"added_{m}_{q}_ms"] or 0.0 for c in configs]
        axes[3].bar([x + (j - 1.5) * 0.2 for x in xs], vals, 0.2, alpha=alpha,
                    color="#1f77b4" if m == "ttft" else "#9467bd", label=f"{m} {q}")  # fmt: skip
    axes[3].axhline(0, color="#444", lw=0.6)
    axes[3].set_xticks(list(xs), configs)
    axes[3].set_title("Added per request over cluster off, paired (ms)", fontsize=9)
    axes[3].legend(fontsize=7)
    fig.suptitle(caption(report), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def caption(report: dict[str, Any]) -> str:
    when = dt.datetime.fromisoformat(report["date"])
    host, a = report["machine"], report["settings"]
    revision = str(report["llama_server"].get("revision", "unknown"))[:9]
    return (
        f"{when:%Y-%m-%d %H:%M %Z}, {host['cpu']} ({host['cpus']} CPUs); tiny-llama "
        f"{'/'.join(a.get('engines', parts.PRECISIONS))} on llama-server (1 thread), llama.cpp "
        f"{revision}; {a['max_tokens']} tokens, Poisson arrivals, {a['step_s']:g} s a step; "
        f"bound {args_bound(report)}"
    )


def args_bound(report: dict[str, Any]) -> str:
    b, f = report["bound_ms"], report["settings"]["bound_factor"]
    return f"{f:g}x unloaded: p99 TTFT <= {b['ttft']:.1f} ms, e2e <= {b['e2e']:.1f} ms"


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{caption(report)}\n\n{paths_table(report['paths']['summary'])}\n")
    print(f"{fleets_table(report['summary'])}\n")
    for fleet, status in report["redis_status"].items():
        got = [s for s in status if s]
        name = label(fleet) if fleet[0].isdigit() else f"cluster paths, {parts.REDIS}"
        print(f"{name}: Redis {[s['redis'] for s in got]}, limit checks made locally "
              f"{sum(s['local_checks'] for s in got)}, failures {sum(s['failures'] for s in got)}, "
              f"stream copy batches {sum(s['batches'] for s in got)}")  # fmt: skip


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--fleets", nargs="+", default=["1-off", "1", "2", "4"],
                   help="N gateways with etcd and Redis; N-off: the cluster off")  # fmt: skip
    p.add_argument("--engines", nargs="+", default=["q8_0"], choices=parts.PRECISIONS,
                   help="one llama-server per precision, the first the reference")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--start-rate", type=float, default=8.0, help="requests/s, first step")
    p.add_argument("--step-factor", type=float, default=1.25)
    p.add_argument("--max-rate", type=float, default=400.0)
    p.add_argument("--step-s", type=float, default=10.0, help="measured, per step, at least")
    p.add_argument("--step-requests", type=int, default=200, help="measured, per step, at least")
    p.add_argument("--warmup-s", type=float, default=2.0, help="sent, not counted, per step")
    p.add_argument("--patience", type=int, default=2, help="steps over the bound in a row")
    p.add_argument("--bound-factor", type=float, default=4.0, help="x the unloaded p99")
    p.add_argument("--path-requests", type=int, default=400, help="rounds of part 1")
    p.add_argument("--path-warmup", type=int, default=20)
    p.add_argument("--idle-s", type=float, default=5.0, help="the gateways' idle CPU, part 1")
    p.add_argument("--slots", type=int, default=32, help="per llama-server, and each pool")
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build it)")
    p.add_argument("--no-pin", action="store_true", help="leave the CPUs unpinned")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/fleet-<when>.json)")
    p.add_argument("--chart", type=Path, help="PNG (default docs/img/bench_fleet_<date>.png)")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--replot", type=Path, help="a run's JSON: its tables and chart again")
    args = p.parse_args(argv)
    for fleet in args.fleets:
        count, _ = fleet_shape(fleet) if fleet.partition("-")[0].isdigit() else (0, "")
        if count < 1 or fleet.partition("-")[2] not in ("", "off"):
            p.error(f"--fleets: {fleet!r} is not N or N-off")
    if args.step_factor <= 1 or args.start_rate <= 0 or args.patience < 1:
        p.error("--step-factor must be > 1, --start-rate > 0, --patience >= 1")
    return args


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through the finally that stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        report = json.loads(args.replot.read_text())
        a, steps = report["settings"], report["steps"]
        report["summary"] = summarize(a["fleets"], steps, report["bound_ms"], a["patience"])
        print_report(report)
        day = dt.datetime.fromisoformat(report["date"])
        chart = args.chart or ROOT / "docs" / "img" / f"bench_fleet_{day:%Y-%m-%d}.png"
        save_chart(report, chart)
        print(f"wrote {chart}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.llama_server is None:
        binary, build = llama_server_binary()
    else:
        binary, record = args.llama_server, args.llama_server.parent / "build.json"
        build = json.loads(record.read_text()) if record.is_file() else {}
    others, gateway_cpus = parts.cpu_sets(args.no_pin)
    if others is not None:
        os.sched_setaffinity(0, {int(c) for c in (gateway_cpus or others).split(",")})
    now = dt.datetime.now().astimezone()
    stamp = f"{now:%Y-%m-%dT%H%M}"
    load_before = os.getloadavg()
    most = max(len(parts.CONFIGS), *(fleet_shape(f)[0] for f in args.fleets))
    tiers = zip(PROMPTS, TIERS, strict=True)
    bodies = [parts.chat_body(p, args.max_tokens, EOS_ID, t) for p, t in tiers]
    with tempfile.TemporaryDirectory(prefix="qr-bench-fleet-") as tmp:
        logs = RESULTS_DIR / "logs" / f"fleet-{stamp}"
        fleet = parts.Backends(Path(tmp), CLUSTER, others, gateway_cpus, logs, args.start_timeout_s)
        try:
            fleet.start(binary, args.engines, args.slots, most, LIMITS)
            log.info("engines, etcd and Redis on CPU %s, the gateways and this client on %s; "
                     "fleets %s", others or "any", gateway_cpus or "any", args.fleets)  # fmt: skip
            got = uvloop.run(measure(fleet, args, bodies))
        except KeyboardInterrupt:
            log.warning("interrupted; the servers are stopped")
            return 130
        finally:
            fleet.stop()
    report = {
        "date": now.isoformat(timespec="seconds"), "machine": machine(), "llama_server": build,
        "revision": parts.revision(),
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "cpus": {"others": others, "gateways": gateway_cpus},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **got, "summary": summarize(args.fleets, got["steps"], got["bound_ms"], args.patience),
    }  # fmt: skip
    out = args.out or RESULTS_DIR / f"fleet-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", out)
    print_report(report)
    if not args.no_chart:
        chart = args.chart or ROOT / "docs" / "img" / f"bench_fleet_{now:%Y-%m-%d}.png"
        save_chart(report, chart)
        log.info("wrote %s", chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())

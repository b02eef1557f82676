"""Serving benchmark: quantroute vs llama.cpp's own llama-server, on the same GGUF file.

One run, per model (the realistic demo model ``stdlib-bpe-llama`` and ``tiny-llama``, both at
``--branch``, q8_0 by default), serves the same file with each of (``serving_systems.py``):

* **quantroute** -- ``quantroute serve``, the request pinned to ``model:branch``;
* **llama-server** -- llama.cpp's C++ server, built by ``scripts/llama_server_build.sh`` from
  the llama.cpp revision llama-cpp-python vendors, with the same portable flags (or
  ``--llama-server PATH``): ``--parallel N``, continuous batching;
* **llama-cpp-python's server**, twice: ``interrupt_requests`` off (it queues requests) and
  on (its default: a new request cuts the running stream; cut streams are counted);
* the **ceiling**: quantroute's own worker process driven over its stdin/stdout protocol
  from this process, with no gateway and no HTTP;
* the **bare gateway** (``bare_gateway.py``): uvicorn and one raw ASGI function over the
  same worker, driven the same way, with nothing else: the floor of a Python gateway.

All run llama.cpp with the same threads (``--threads``, 1), ``--parallel`` slots (16) of
``--n-ctx`` (512) tokens each, and prompt caching off (quantroute's worker has none yet:
llama-server gets ``cache_prompt: false``, ``--cache-reuse 0``, ``--cache-ram 0``).

Every request is the same: the prompt, ``max_tokens``, ``temperature: 0`` and a ``logit_bias``
of -100 on end-of-sequence, so every stream that is not cut has exactly ``max_tokens`` tokens
of the same greedy text. **The run fails** (exit status 1) when any uncut stream's text differs
from the ceiling's, or its token count cannot be trusted. Tokens are counted one way for all:
the usage the system reports (its last chunk, or the worker's ``fin``), else its text chunks
(llama-cpp-python's server streams no usage); checked against the chunks (never more chunks
than tokens) and ``max_tokens``.

Per system and number of clients (``--clients``, 1 4 16), each of ``--rounds`` rounds (5)
runs that many closed-loop clients (each sends its next request when its stream ends) for at
least ``--min-round-s`` (2 s; 10 s of streaming per cell over 5 rounds). Only one system runs
at a time: in each round every system is started, warmed up, measured at each client count
and stopped, in an order that rotates round by round, so noise falls on all of them.

Then, per model, **one client's TTFT, paired**: quantroute, llama-server and the bare gateway
up at once, one client's requests alternating between them request by request (who goes
first rotates round by round), ``--paired-rounds`` (8) rounds of ``--paired-requests`` (5)
requests each of ``--paired-max-tokens`` (8): the machine's drift, which moves the rounds
above by 10-20 % between systems minutes apart, falls on all three alike. Reported: the
median over rounds of each round's median TTFT ratio.

Reported per cell: aggregate tok/s (tokens / wall), median TTFT (sent to the first text
chunk), p99 inter-token latency (gaps between text chunks, pooled), and CPU time per token of
the system's whole process tree (psutil; quantroute's gateway and worker; the ceiling's
worker alone) and, for quantroute and the bare gateway, of the gateway process alone (its
workers apart: the performance issue's "gateway CPU per streamed token" with llama.cpp), with
the ratios quantroute / llama-server and the goals met or not.

The client runs in this process on uvloop and reads the HTTP systems' streams with a lean
HTTP/1.1 reader (``lean_http.py``, about 90 µs of CPU per chunk here, where httpx over h11
took 170-250): on a small machine the client shares the cores with the server it measures,
so its cost is kept low, and it is the same for every HTTP system.

Run::

    make bench                                     # the full run, about 12 minutes on 2 cores
    make bench ARGS="--rounds 1 --min-round-s 0.5 --models tiny-llama"   # a smoke run
    .venv/bin/python benchmarks/bench_serving.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import logging
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import uvloop

from serving_systems import (
    ALL_SYSTEMS,
    BARE,
    CEILING,
    LABELS,
    LCP,
    LLAMA_SERVER,
    QUANTROUTE,
    Settings,
    Stream,
    System,
    WorkerCeiling,
    Workload,
    bare_gateway_system,
    lcp_system,
    llama_server_system,
    quantroute_system,
)
from stats import fmt, median, p99

log = logging.getLogger("bench_serving")

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_CHART = ROOT / "docs" / "img" / "bench_serving.png"
BUILD_SCRIPT = ROOT / "scripts" / "llama_server_build.sh"
REALISTIC, TINY = "stdlib-bpe-llama", "tiny-llama"
PROMPT = (
    "import os\nimport sys\n\n\ndef read_config(path):\n"
    '    """Read a key = value file into a dict."""\n    result = {}\n'
)
# quantroute / llama-server, per model: (least aggregate decode, most TTFT or None)
# The goals (docs/benchmarks.md, "Goals"): quantroute's gateway CPU per streamed token at
# most GATEWAY_CPU_MAX x the bare gateway's at 1, 4 and 16 clients, every model; on the
# realistic model, aggregate decode at least DECODE_MIN x llama-server's and median TTFT at
# most TTFT_MAX x at 4 and 16 clients.
GATEWAY_CPU_MAX = 1.15
GATEWAY_CPU_CLIENTS = (1, 4, 16)
DECODE_MIN, TTFT_MAX = 1.0, 1.1
DECODE_GOALS: dict[str, tuple[int, ...]] = {REALISTIC: (4, 16)}


_p99 = p99  # the name tests/build/test_bench_serving.py reads it by


# -- records ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Round:
    """One system at one client count, in one round."""

    model: str
    system: str
    clients: int
    index: int
    wall_s: float
    cpu_s: float
    streams: tuple[Stream, ...]
    retries: int = 0  # requests sent again after a stale kept-alive connection
    gateway_cpu_s: float | None = None  # a Python gateway's own process, its workers apart

    def record(self) -> dict[str, Any]:
        return {
            "model": self.model, "system": self.system, "clients": self.clients,
            "round": self.index, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
            "gateway_cpu_s": self.gateway_cpu_s, "retries": self.retries,
            "streams": [
                {"ttft_ms": None if s.ttft_s is None else s.ttft_s * 1e3, "tokens": s.tokens,
                 "chunks": s.chunks, "usage_tokens": s.usage_tokens,
                 "finish_reason": s.finish_reason, "error": s.error}
                for s in self.streams
            ],
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Cell:
    """One system at one client count, over all its rounds."""

    model: str
    system: str
    clients: int
    rounds: int
    streams: int
    cut: int
    errors: int
    count_errors: int
    text_mismatches: int
    tokens: int
    wall_s: float
    aggregate_tok_s: float
    median_ttft_ms: float | None
    p99_itl_ms: float | None
    cpu_us_per_token: float | None
    gateway_cpu_us_per_token: float | None  # quantroute's and the bare gateway's own process
    round_tok_s_min: float  # the spread of the rounds' aggregate rates
    round_tok_s_max: float
    retries: int

    @classmethod
    def of(cls, rounds: list[Round], max_tokens: int, reference: str | None) -> Cell:
        streams = [s for r in rounds for s in r.streams]
        wall_s = sum(r.wall_s for r in rounds)
        tokens = sum(s.tokens for s in streams)
        cpu_s = sum(r.cpu_s for r in rounds)
        whole = [s for s in streams if s.error is None and not s.cut]
        ttft = [s.ttft_s for s in streams if s.ttft_s is not None]
        rates = [sum(s.tokens for s in r.streams) / r.wall_s for r in rounds if r.wall_s > 0]
        rates = rates or [0.0]
        gateway = [r.gateway_cpu_s for r in rounds]
        gateway_s = None if None in gateway else sum(g or 0.0 for g in gateway)
        return cls(
            model=rounds[0].model,
            system=rounds[0].system,
            clients=rounds[0].clients,
            rounds=len(rounds),
            streams=len(streams),
            cut=sum(s.cut and s.error is None for s in streams),
            errors=sum(s.error is not None for s in streams),
            count_errors=sum(s.count_error(max_tokens) is not None for s in streams),
            text_mismatches=sum("".join(s.text) != reference for s in whole),
            tokens=tokens,
            wall_s=wall_s,
            aggregate_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
            median_ttft_ms=None if (m := median(ttft)) is None else m * 1e3,
            p99_itl_ms=None if (p := p99([g for s in streams for g in s.gaps_s])) is None
            else p * 1e3,
            cpu_us_per_token=cpu_s / tokens * 1e6 if tokens else None,
            gateway_cpu_us_per_token=None if gateway_s is None or not tokens
            else gateway_s / tokens * 1e6,
            round_tok_s_min=min(rates), round_tok_s_max=max(rates),
            retries=sum(r.retries for r in rounds),
        )  # fmt: skip

    def failures(self) -> list[str]:
        """What makes this cell's numbers wrong (the run fails on any)."""
        out = []
        if self.text_mismatches:
            out.append(f"{self.text_mismatches} stream(s) with other text than the ceiling's")
        if self.count_errors:
            out.append(f"{self.count_errors} stream(s) whose token count does not check")
        if self.errors and self.system != LCP:  # LCP's cut streams may end in a reset
            out.append(f"{self.errors} failed stream(s)")
        if self.cut and self.system != LCP:
            out.append(f"{self.cut} stream(s) cut")
        return [f"{self.model}, {LABELS[self.system]}, {self.clients} client(s): {f}" for f in out]


def ratios(cells: dict[tuple[str, str, int], Cell], model: str, n: int) -> dict[str, float | None]:
    """quantroute / llama-server (and / the ceiling, / the bare gateway) for one model and
    client count."""
    qr, peer, top, bare = (
        cells.get((model, s, n)) for s in (QUANTROUTE, LLAMA_SERVER, CEILING, BARE)
    )

    def r(a: Cell | None, b: Cell | None, metric: str) -> float | None:
        x, y = (None if c is None else getattr(c, metric) for c in (a, b))
        return x / y if x is not None and y else None

    return {
        "decode": r(qr, peer, "aggregate_tok_s"),
        "ttft": r(qr, peer, "median_ttft_ms"),
        "itl_p99": r(qr, peer, "p99_itl_ms"),
        "cpu_per_token": r(qr, peer, "cpu_us_per_token"),
        "decode_vs_ceiling": r(qr, top, "aggregate_tok_s"),
        "decode_vs_bare": r(qr, bare, "aggregate_tok_s"),
        "ttft_vs_bare": r(qr, bare, "median_ttft_ms"),
        "gateway_cpu_vs_bare": r(qr, bare, "gateway_cpu_us_per_token"),
    }


def goal_lines(
    cells: dict[tuple[str, str, int], Cell], model: str, clients: list[int]
) -> list[tuple[str, bool]]:
    """Each goal this run measured, with its figure and whether it is met."""
    out = []
    for n in clients:
        rt = ratios(cells, model, n)
        cpu = rt["gateway_cpu_vs_bare"]
        if n in GATEWAY_CPU_CLIENTS and cpu is not None:
            out.append((f"{model}, {n} client(s): gateway CPU per token <= {GATEWAY_CPU_MAX}x "
                        f"the bare gateway's ({cpu:.2f}x)", cpu <= GATEWAY_CPU_MAX))  # fmt: skip
        if n not in DECODE_GOALS.get(model, ()):
            continue
        if rt["decode"] is not None:
            out.append((f"{model}, {n} client(s): aggregate decode >= {DECODE_MIN}x llama-server "
                        f"({rt['decode']:.2f}x)", rt["decode"] >= DECODE_MIN))  # fmt: skip
        if rt["ttft"] is not None:
            out.append((f"{model}, {n} client(s): median TTFT <= {TTFT_MAX}x llama-server "
                        f"({rt['ttft']:.2f}x)", rt["ttft"] <= TTFT_MAX))  # fmt: skip
    return out


# -- the run ----------------------------------------------------------------------


async def closed_loop(system: System, work: Workload, clients: int, min_s: float) -> list[Stream]:
    """``clients`` clients, each sending its next request as its stream ends, for min_s."""
    end = time.perf_counter() + min_s
    streams: list[Stream] = []

    async def client() -> None:
        while True:
            streams.append(await system.stream(work))
            if time.perf_counter() >= end:
                return

    await asyncio.gather(*(client() for _ in range(clients)))
    return streams


async def settle(system: System, timeout_s: float = 120.0) -> None:
    """Wait until the system's processes are idle (under 5 % of a core over half a second):
    a server that is ready may still load other branches or warm up in the background."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        before = system.cpu_s()
        await asyncio.sleep(0.5)
        if system.cpu_s() - before < 0.025:
            return
    log.warning("%s did not go idle in %.0f s; measuring anyway", system.name, timeout_s)


async def run_system(
    system: System, work: Workload, args: argparse.Namespace, model: str, index: int
) -> list[Round]:
    """Start one system, warm it up, measure each client count once, stop it."""
    await asyncio.to_thread(system.start, args.start_timeout_s)
    rounds: list[Round] = []
    try:
        await system.open()
        await settle(system)
        await closed_loop(system, work, max(args.clients), 0.0)  # warm-up, not recorded
        await settle(system)
        for n in args.clients:
            cpu, start, retries = system.cpu_s(), time.perf_counter(), system.retries
            gateway = system.gateway_cpu_s()
            streams = await closed_loop(system, work, n, args.min_round_s)
            wall, used = time.perf_counter() - start, system.cpu_s() - cpu
            after = system.gateway_cpu_s()
            gateway = None if gateway is None or after is None else after - gateway
            rounds.append(
                Round(model, system.name, n, index, wall, used, tuple(streams),
                      system.retries - retries, gateway)
            )  # fmt: skip
            tokens = sum(s.tokens for s in streams)
            log.info(
                "%s round %d  %-24s %2d client(s)  %7.1f tok/s  %3d streams  %.0f µs CPU/token%s",
                *(model, index + 1, system.name, n, tokens / wall, len(streams)),
                used / max(tokens, 1) * 1e6,
                "" if gateway is None else f" (gateway {gateway / max(tokens, 1) * 1e6:.0f})",
            )
    finally:
        await system.close()
        await asyncio.to_thread(system.stop)
    return rounds


PAIRED = (QUANTROUTE, LLAMA_SERVER, BARE)  # the systems one client's TTFT is compared across


async def paired_ttft(
    systems: list[System], work: Workload, rounds: int, per_round: int, start_timeout_s: float
) -> dict[str, list[float]]:
    """One client's time to first token with ``systems`` up at once and its requests
    alternating between them (A, B, C, A, B, C, ...; who goes first rotates round by round),
    so that what the machine does meanwhile falls on all of them alike, where the rounds
    above measure one system at a time, minutes apart. Each system's median TTFT (s) per
    round."""
    started: list[System] = []
    medians: dict[str, list[float]] = {s.name: [] for s in systems}
    try:
        for system in systems:
            await asyncio.to_thread(system.start, start_timeout_s)
            started.append(system)
            await system.open()
        for system in systems:
            await settle(system)
            await system.stream(work)  # warm-up, not recorded
        for index in range(rounds):
            shift = index % len(systems)
            order = systems[shift:] + systems[:shift]
            seen: dict[str, list[float]] = {s.name: [] for s in systems}
            for _ in range(per_round):
                for system in order:
                    ttft = (await system.stream(work)).ttft_s
                    if ttft is not None:
                        seen[system.name].append(ttft)
            for name, values in seen.items():  # rounds stay aligned: NaN for none
                medians[name].append(math.nan if (m := median(values)) is None else m)
    finally:
        for system in reversed(started):
            await system.close()
            await asyncio.to_thread(system.stop)
    return medians


def paired_ratio(medians: dict[str, list[float]], system: str, peer: str) -> float | None:
    """The median, over the rounds of :func:`paired_ttft`, of ``system``'s median TTFT over
    ``peer``'s in the same round."""
    if system not in medians or peer not in medians:
        return None
    pairs = [a / b for a, b in zip(medians[system], medians[peer], strict=True) if b > 0 and a == a]
    return median(pairs)


def paired_lines(
    model: str, medians: dict[str, list[float]], args: argparse.Namespace
) -> list[str]:
    if not medians:
        return []
    rounds = f"{args.paired_rounds} rounds of {args.paired_requests} requests each"
    parts = []
    for name in (QUANTROUTE, BARE):
        got = paired_ratio(medians, name, LLAMA_SERVER)
        if got is not None:
            parts.append(f"{name} / {LLAMA_SERVER} {got:.2f}x")
    return [
        f"{model}, 1 client, paired (systems up at once, requests alternating, {rounds}, "
        f"max_tokens {args.paired_max_tokens}): median TTFT " + ", ".join(parts)
    ]


def eos_id(model_path: Path) -> int:
    from llama_cpp import Llama

    with contextlib.redirect_stderr(None):
        vocab = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    return int(vocab.token_eos())


def make_systems(
    args: argparse.Namespace, repo: Path, path: Path, model_id: str, cfg: Settings, logs: Path
) -> list[System]:
    made: dict[str, System] = {
        QUANTROUTE: quantroute_system(repo, cfg, logs),
        LLAMA_SERVER: llama_server_system(args.llama_server, path, cfg, logs),
        "llama-cpp-python-queue": lcp_system(path, model_id, cfg, logs, interrupt=False),
        LCP: lcp_system(path, model_id, cfg, logs, interrupt=True),
        CEILING: WorkerCeiling(path, cfg, logs),
        BARE: bare_gateway_system(path, cfg, logs),
    }
    return [made[name] for name in args.systems]


async def run_model(
    args: argparse.Namespace, model: str, repo: Path
) -> tuple[list[Round], str, dict[str, list[float]]]:
    path = model_file(repo, model, args.branch)
    model_id = f"{model}:{args.branch}"
    work = Workload(model_id, args.prompt, args.max_tokens, eos_id(path), args.prompt_cache)
    cfg = Settings(args.threads, args.parallel, args.n_ctx, args.prompt_cache, args.n_gpu_layers)
    systems = make_systems(args, repo, path, model_id, cfg, RESULTS_DIR / "logs" / model)
    log.info("%s (%s): %d round(s) of %s", model_id, path, args.rounds, args.systems)
    rounds: list[Round] = []
    for index in range(args.rounds):
        shift = index % len(systems)  # who goes first rotates, round by round
        for system in systems[shift:] + systems[:shift]:
            rounds += await run_system(system, work, args, model, index)
    paired: dict[str, list[float]] = {}
    pair = [s for s in systems if s.name in PAIRED]
    if args.paired_rounds and len(pair) > 1 and any(s.name == LLAMA_SERVER for s in pair):
        short = replace(work, max_tokens=args.paired_max_tokens)
        log.info("%s: paired one-client TTFT of %s", model_id, [s.name for s in pair])
        paired = await paired_ttft(
            pair, short, args.paired_rounds, args.paired_requests, args.start_timeout_s
        )
    return rounds, str(path), paired


def reference_text(rounds: list[Round]) -> str | None:
    """The ceiling's greedy text (else quantroute's): what every other stream must equal."""
    for name in (CEILING, QUANTROUTE):
        for r in rounds:
            for s in r.streams:
                if r.system == name and s.error is None and not s.cut:
                    return "".join(s.text)
    return None


def bandwidth_lines(
    cells: dict[tuple[str, str, int], Cell], model: str, path: Path, args: argparse.Namespace
) -> list[str]:
    """Decode as a fraction of the memory-bandwidth limit: a decode step reads every weight
    once and yields one token per sequence, so N sequences make at most N x bandwidth / bytes
    tokens per second (KV-cache reads, small at these lengths, are left out)."""
    size = path.stat().st_size
    out = []
    for (m, system, n), cell in cells.items():
        if m == model:
            limit = min(n, args.parallel) * args.hbm_gbps * 1e9 / size
            out.append(
                f"{model}, {LABELS[system]}, {n} client(s): {cell.aggregate_tok_s:.0f} tok/s = "
                f"{cell.aggregate_tok_s / limit:.1%} of the bandwidth limit ({limit:.0f} tok/s "
                f"for {size / 1e9:.2f} GB per step at {args.hbm_gbps:.0f} GB/s)"
            )
    return out


# -- reporting ----------------------------------------------------------------------

COLUMNS = (
    "Clients", "System", "Aggregate (tok/s)", "Rounds, min-max", "Median TTFT (ms)", "p99 ITL (ms)",
    "CPU per token (µs)", "Gateway CPU per token (µs)", "Streams (cut or failed)", "Same text",
)  # fmt: skip


def table_rows(
    cells: dict[tuple[str, str, int], Cell], model: str, args: argparse.Namespace
) -> list[list[str]]:
    return [
        [
            str(n), LABELS[c.system], fmt(c.aggregate_tok_s),
            f"{c.round_tok_s_min:.0f}-{c.round_tok_s_max:.0f}", fmt(c.median_ttft_ms, 2),
            fmt(c.p99_itl_ms, 2), fmt(c.cpu_us_per_token, 0),
            fmt(c.gateway_cpu_us_per_token, 0), f"{c.streams} ({c.cut + c.errors})",
            "yes" if not c.text_mismatches else f"{c.text_mismatches} differ",
        ]
        for n in args.clients
        for system in args.systems
        if (c := cells.get((model, system, n))) is not None
    ]  # fmt: skip


def ratio_lines(
    cells: dict[tuple[str, str, int], Cell], model: str, clients: list[int]
) -> list[str]:
    out = []
    for n in clients:
        rt = ratios(cells, model, n)
        out.append(
            f"{model}, {n} client(s), quantroute / llama-server: aggregate decode "
            f"{fmt(rt['decode'], 2)}x, median TTFT {fmt(rt['ttft'], 2)}x, p99 ITL "
            f"{fmt(rt['itl_p99'], 2)}x, CPU per token {fmt(rt['cpu_per_token'], 2)}x; "
            f"quantroute / ceiling: aggregate decode {fmt(rt['decode_vs_ceiling'], 2)}x; "
            f"quantroute / bare gateway: aggregate decode {fmt(rt['decode_vs_bare'], 2)}x, "
            f"median TTFT {fmt(rt['ttft_vs_bare'], 2)}x"
        )
    return out


def markdown(rows: list[list[str]]) -> str:
    align = ["---:", "---"] + ["---:"] * (len(COLUMNS) - 3) + ["---"]
    return "\n".join("| " + " | ".join(r) + " |" for r in [[*COLUMNS], align, *rows])


def plain(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = [[*COLUMNS], ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


COLORS = {QUANTROUTE: "#1f77b4", LLAMA_SERVER: "#ff7f0e", "llama-cpp-python-queue": "#999",
          LCP: "#ccc", CEILING: "#2ca02c", BARE: "#9467bd"}  # fmt: skip


def save_chart(
    cells: dict[tuple[str, str, int], Cell], args: argparse.Namespace, caption: str, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (
        ("aggregate_tok_s", "Aggregate decode (tok/s, higher is better)"),
        ("median_ttft_ms", "Median TTFT (ms, lower is better)"),
        ("cpu_us_per_token", "CPU per token, process tree (µs, lower is better)"),
    )
    fig, axes = plt.subplots(
        len(args.models), 3, figsize=(15, 4.2 * len(args.models)), squeeze=False
    )
    width = 0.8 / len(args.systems)
    xs = range(len(args.clients))
    for row, model in zip(axes, args.models, strict=True):
        for ax, (metric, title) in zip(row, metrics, strict=True):
            for i, system in enumerate(args.systems):
                values = [
                    getattr(cells[(model, system, n)], metric) or 0.0
                    if (model, system, n) in cells
                    else 0.0
                    for n in args.clients
                ]
                ax.bar([x + (i - (len(args.systems) - 1) / 2) * width for x in xs], values, width,
                       label=LABELS[system], color=COLORS[system])  # fmt: skip
            ax.set_title(f"{model}: {title}", fontsize=9)
            ax.set_xticks(list(xs), [f"{n} client{'s' if n > 1 else ''}" for n in args.clients])
            if metric != "aggregate_tok_s":
                ax.set_yscale("log")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=len(args.systems), fontsize=8, frameon=False
    )
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {"python": platform.python_version()}
    for dist in ("quantroute", "llama_cpp_python", "httpx", "uvicorn"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(), "versions": versions}  # fmt: skip


# -- main ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[REALISTIC, TINY], help="model folders")
    p.add_argument("--repo", type=Path, help="repository of --models (default: the demo's)")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="layers offloaded, for all")
    p.add_argument(
        "--hbm-gbps", type=float, help="memory bandwidth (GB/s): report decode / its limit"
    )
    p.add_argument("--branch", default="q8_0", help="branch (precision) every system serves")
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build it)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per cell")
    p.add_argument("--min-round-s", type=float, default=2.0, help="streaming per cell and round")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads, for all")
    p.add_argument("--n-ctx", type=int, default=512, help="context per sequence, for all")
    p.add_argument("--parallel", type=int, help="slots for all (default: the most clients)")
    p.add_argument(
        "--prompt-cache", action="store_true", help="prompt caching on in all (off by default)"
    )
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=8,
        help="rounds of the paired one-client TTFT (quantroute, llama-server and the bare "
        "gateway up at once, requests alternating); 0: none",
    )
    p.add_argument("--paired-requests", type=int, default=5, help="per system and paired round")
    p.add_argument("--paired-max-tokens", type=int, default=8)
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/...)")
    p.add_argument("--chart", type=Path, default=DEFAULT_CHART)
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--markdown", action="store_true", help="also print markdown tables")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2 or min(args.clients) < 1:
        p.error("--rounds and --clients must be >= 1, --max-tokens >= 2")
    args.clients = sorted(set(args.clients))
    args.parallel = args.parallel or max(args.clients)
    args.systems = [s for s in ALL_SYSTEMS if s in args.systems]
    return args


def model_repo(model: str, repo: Path | None) -> Path:
    if repo is not None:
        return repo
    if model == TINY:
        return ROOT / "src" / "quantroute" / "demo" / "repo"
    from quantroute.demo import BPE_MODEL_NAME, ensure_demo_repo

    return ensure_demo_repo(BPE_MODEL_NAME, progress=True)


def model_file(repo: Path, model: str, branch: str) -> Path:
    from quantroute.registry.manifest import load_manifest

    manifest = load_manifest(repo / model)
    if branch not in manifest.branches:
        raise SystemExit(f"{model} has no branch {branch!r}; it has {sorted(manifest.branches)}")
    return repo / model / manifest.branches[branch].file


def llama_server_binary() -> tuple[Path, dict[str, Any]]:
    """Build (once, cached) or find llama-server; the build's record (revision, flags)."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), sys.executable], stdout=subprocess.PIPE, text=True, check=False
    )  # its progress goes to stderr, shown as it builds
    if done.returncode != 0:
        raise SystemExit("llama-server build failed (see above)")
    binary = Path(done.stdout.strip().splitlines()[-1])
    return binary, json.loads((binary.parent / "build.json").read_text())


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_sigterm)
    build: dict[str, Any] = {"binary": str(args.llama_server)}
    record = None if args.llama_server is None else args.llama_server.parent / "build.json"
    if record is not None and record.is_file():  # one our build script made: its revision
        build = {**json.loads(record.read_text()), "binary": str(args.llama_server)}
    if args.llama_server is None and LLAMA_SERVER in args.systems:
        args.llama_server, build = llama_server_binary()
    now = dt.datetime.now().astimezone()
    host = machine()
    rounds: list[Round] = []
    files: dict[str, str] = {}
    paired: dict[str, dict[str, list[float]]] = {}
    try:
        for model in args.models:
            # uvloop, as uvicorn serves with: the client's own CPU is shared with the servers
            got, files[model], paired[model] = uvloop.run(
                run_model(args, model, model_repo(model, args.repo))
            )
            rounds += got
    except KeyboardInterrupt:
        log.warning("interrupted; the servers are stopped")
        return 130

    cells: dict[tuple[str, str, int], Cell] = {}
    references = {}
    for model in args.models:
        mine = [r for r in rounds if r.model == model]
        references[model] = reference_text(mine)
        for key in sorted({(r.system, r.clients) for r in mine}):
            sel = [r for r in mine if (r.system, r.clients) == key]
            cells[(model, *key)] = Cell.of(sel, args.max_tokens, references[model])
    revision = build.get("revision", "unknown")
    settings = (
        f"branch {args.branch}, max_tokens {args.max_tokens}, {args.rounds} rounds of >= "
        f"{args.min_round_s} s per cell, {args.threads} llama.cpp thread(s), {args.parallel} "
        f"slots of {args.n_ctx} tokens, prompt cache {'on' if args.prompt_cache else 'off'}; "
        f"llama.cpp {revision[:9]}"
    )
    where = f"{now:%Y-%m-%d}, {host['cpu']} ({host['cpus']} CPUs)"
    goals: list[tuple[str, bool]] = []
    print(f"\n{where}; {settings}")
    for model in args.models:
        rows = table_rows(cells, model, args)
        lines = ratio_lines(cells, model, args.clients) + paired_lines(model, paired[model], args)
        print(f"\n{model}\n{plain(rows)}\n" + "\n".join(lines))
        if args.markdown:
            print(f"\n{markdown(rows)}\n")
        goals += goal_lines(cells, model, args.clients)
        if args.hbm_gbps:
            print("\n".join(bandwidth_lines(cells, model, Path(files[model]), args)))
    print("\n" + "\n".join(f"goal {g}: {'met' if met else 'NOT met'}" for g, met in goals))
    failures = [f for c in cells.values() for f in c.failures()]
    for failure in failures:
        log.error("FAILED: %s", failure)

    out = args.out or RESULTS_DIR / f"serving-{now:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": now.isoformat(timespec="seconds"),
        "machine": host,
        "llama_server": build,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_files": files,
        "reference_text": references,
        "cells": [asdict(c) for c in cells.values()],
        "ratios": {m: {n: ratios(cells, m, n) for n in args.clients} for m in args.models},
        "goals": dict(goals),
        "paired_ttft_s": paired,  # per model and system: the median TTFT of each paired round
        "failures": failures,
        "rounds": [r.record() for r in rounds],
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", out)
    if not args.no_chart:
        save_chart(cells, args, f"{where}; {settings}", args.chart)
        log.info("wrote %s", args.chart)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

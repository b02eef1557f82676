"""Two versions of quantroute's code side by side: throughput and the gateway's own CPU.

The serving benchmark (``bench_serving.py``) compares quantroute with its peers, one
system at a time, minutes apart. To tell whether a change to quantroute's own path moved
anything on a machine whose speed drifts by 10-20 % between minutes (and by 2-3x between
its modes: docs/benchmarks.md, "Two modes of one machine"), this runs the versions *at
once*: each ``--tree NAME=SRC`` is ``quantroute serve`` with ``PYTHONPATH=SRC`` (a git
worktree's ``src`` for the code before, this checkout's for the code after), beside the
bare gateway and llama-server if asked for, all up together. Each cell (a client count)
runs ``--rounds`` rounds; in a round every system in turn (the order rotates) streams
for ``--seconds`` to that many closed-loop clients, with the serving benchmark's workload
and client. Reported per system: the median of its rounds' aggregate tok/s, the median over
rounds of its rate / the reference's in the same round (the last system: llama-server,
else the bare gateway, else the last tree), and CPU per token of the gateway process
alone, of its workers (psutil: the server's own process, then its children) and of the
clients reading its streams (this process: the same client for every system), and the
gateway's CPU per request; with ``--chart``, a plot of both. Prompt caching is off in
every system unless ``--prompt-cache`` (then a request prefills its last few tokens, and
a short ``--max-tokens`` shows what a request costs the gateway apart from its tokens).

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab_serving.py --tree before=/tmp/before/src --tree after=src --bare \
        --llama-server --chart /tmp/ab.png

The trees run the interpreter and packages of this venv; the worker processes they start
run their tree's code too (the environment carries ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop

import bench_serving as bench
from serving_systems import (
    BARE,
    LLAMA_SERVER,
    HttpSystem,
    Settings,
    Workload,
    bare_gateway_system,
    llama_server_system,
    quantroute_system,
)

log = logging.getLogger("ab_serving")


@dataclass(frozen=True, slots=True)
class Burst:
    model: str
    system: str
    clients: int
    round: int
    tokens: int
    wall_s: float
    gateway_s: float  # the server's own process
    workers_s: float  # its children
    client_s: float  # this process: the clients reading the streams
    requests: int = 0  # the streams it served


def split_cpu_s(system: HttpSystem) -> tuple[float, float]:
    """CPU seconds so far of the server's own process and of its children."""
    own = system.server.own_cpu_s()
    return own, system.server.cpu_s() - own


async def burst(
    model: str, system: HttpSystem, work: Workload, clients: int, seconds: float, i: int
) -> Burst:
    own, children = split_cpu_s(system)
    start, client = time.perf_counter(), time.process_time()
    streams = await bench.closed_loop(system, work, clients, seconds)
    wall, client = time.perf_counter() - start, time.process_time() - client
    own_after, children_after = split_cpu_s(system)
    tokens = sum(s.tokens for s in streams)
    failed = [s for s in streams if s.error is not None or s.count_error(work.max_tokens)]
    if failed:
        raise SystemExit(f"{system.name}: {len(failed)} stream(s) failed or miscounted")
    gateway_s, workers_s = own_after - own, children_after - children
    return Burst(
        model, system.name, clients, i, tokens, wall, gateway_s, workers_s, client, len(streams)
    )


async def run(args: argparse.Namespace, model: str) -> list[Burst]:
    repo = bench.model_repo(model, None)
    path = bench.model_file(repo, model, args.branch)
    cfg = Settings(1, 16, 512, args.prompt_cache, 0)
    logs = bench.RESULTS_DIR / "logs" / "ab"
    work = Workload(
        f"{model}:{args.branch}", bench.PROMPT, args.max_tokens, bench.eos_id(path), False
    )
    # Each made just before it starts: its free port is taken at once, not after the
    # connections to the ones before have used ephemeral ports for a while.
    makers = [
        functools.partial(quantroute_system, repo, cfg, logs, name=name, src=src)
        for name, src in args.tree
    ]
    if args.bare:
        makers.append(functools.partial(bare_gateway_system, path, cfg, logs))
    if args.llama_server:
        binary = args.llama_server_binary or bench.llama_server_binary()[0]
        makers.append(functools.partial(llama_server_system, binary, path, cfg, logs))
    systems: list[HttpSystem] = []
    bursts: list[Burst] = []
    try:
        for make in makers:
            system = make()
            await asyncio.to_thread(system.start, 180.0)
            systems.append(system)
            await system.open()
        for system in systems:
            await bench.settle(system)
            await bench.closed_loop(system, work, max(args.clients), 1.0)  # warm-up
        for clients in args.clients:
            for i in range(args.rounds):
                shift = i % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    got = await burst(model, system, work, clients, args.seconds, i)
                    bursts.append(got)
                    log.info(
                        "%s %d client(s) round %d %-14s %7.0f tok/s  gateway %6.1f µs/token",
                        model, clients, i + 1, got.system, got.tokens / got.wall_s,
                        got.gateway_s / max(got.tokens, 1) * 1e6,
                    )  # fmt: skip
    finally:
        for system in reversed(systems):
            await system.close()
            await asyncio.to_thread(system.stop)
    return bursts


@dataclass(frozen=True, slots=True)
class Cell:
    """One system at one client count: its rounds together."""

    tok_s: float  # the median of the rounds' aggregate rates
    ratio: float  # the median of its rate / the reference's, round by round
    ratio_min: float
    ratio_max: float
    gateway_us: float  # CPU per token: the server's own process
    workers_us: float  # and its children
    client_us: float  # and the clients'
    gateway_request_us: float  # the server's own process, per request

    @classmethod
    def of(cls, cell: list[Burst], reference: list[Burst]) -> Cell:
        ref = {b.round: b.tokens / b.wall_s for b in reference}
        ratios = [b.tokens / b.wall_s / ref[b.round] for b in cell if ref.get(b.round)]
        tokens = sum(b.tokens for b in cell) or 1
        requests = sum(b.requests for b in cell) or 1
        return cls(
            statistics.median(b.tokens / b.wall_s for b in cell),
            statistics.median(ratios), min(ratios), max(ratios),
            sum(b.gateway_s for b in cell) / tokens * 1e6,
            sum(b.workers_s for b in cell) / tokens * 1e6,
            sum(b.client_s for b in cell) / tokens * 1e6,
            sum(b.gateway_s for b in cell) / requests * 1e6,
        )  # fmt: skip


def cells(bursts: list[Burst], names: list[str], reference: str) -> dict[tuple[int, str], Cell]:
    """Per (clients, system) of one model."""
    out = {}
    for clients in sorted({b.clients for b in bursts}):
        mine = {n: [b for b in bursts if b.system == n and b.clients == clients] for n in names}
        for name in names:
            out[(clients, name)] = Cell.of(mine[name], mine[reference])
    return out


def table(got: dict[tuple[int, str], Cell]) -> list[list[str]]:
    return [
        [
            str(clients), name, f"{c.tok_s:.0f}",
            f"{c.ratio:.2f} ({c.ratio_min:.2f}-{c.ratio_max:.2f})",
            f"{c.gateway_us:.0f}" if name != LLAMA_SERVER else f"({c.gateway_us:.0f}, all of it)",
            f"{c.workers_us:.0f}" if name != LLAMA_SERVER else "-", f"{c.client_us:.0f}",
            f"{c.gateway_request_us:.0f}" if name != LLAMA_SERVER else "-",
        ]
        for (clients, name), c in got.items()
    ]  # fmt: skip


def save_chart(
    by_model: dict[str, dict[tuple[int, str], Cell]], reference: str, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_model), 2, figsize=(12, 3.8 * len(by_model)), squeeze=False)
    for row, (model, got) in zip(axes, by_model.items(), strict=True):
        clients = sorted({n for n, _ in got})
        names = [s for n, s in got if n == clients[0]]
        width = 0.8 / len(names)
        for ax, metric, title in (
            (row[0], "gateway_us", "gateway process's CPU per token (µs, lower is better)"),
            (row[1], "ratio", f"aggregate decode / {reference}'s, same round (higher is better)"),
        ):
            for i, name in enumerate(names):
                if metric == "gateway_us" and name == LLAMA_SERVER:
                    continue  # one process with its engine: not a gateway's figure
                xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(clients))]
                ax.bar(xs, [getattr(got[(n, name)], metric) for n in clients], width, label=name)
            ax.set_xticks(range(len(clients)), [f"{n} client{'s' * (n > 1)}" for n in clients])
            ax.set_title(f"{model}: {title}", fontsize=9)
            if metric == "ratio":
                ax.axhline(1.0, color="#888", linewidth=0.8)
        row[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ["Clients", "System", "Aggregate (tok/s)", "/ {ref}, rounds min-max",
           "Gateway CPU per token (µs)", "Workers' CPU per token (µs)",
           "Client CPU per token (µs)", "Gateway CPU per request (µs)"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])

    def tree(text: str) -> tuple[str, Path]:
        name, sep, src = text.partition("=")
        if not sep or not name or not (Path(src) / "quantroute").is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is not NAME=SRC with SRC/quantroute")
        return name, Path(src)

    p.add_argument("--tree", type=tree, action="append", required=True, help="NAME=SRC")
    p.add_argument("--bare", action="store_true", help="the bare gateway too")
    p.add_argument("--llama-server", action="store_true", help="llama-server too")
    p.add_argument("--llama-server-binary", type=Path, help="default: build or reuse the cache")
    p.add_argument(
        "--models", nargs="+", default=[bench.REALISTIC, bench.TINY],
        choices=[bench.TINY, bench.REALISTIC],
    )  # fmt: skip
    p.add_argument("--chart", type=Path, help="a plot of the cells (PNG)")
    p.add_argument("--branch", default="q8_0")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=3.0, help="per system, round and cell")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--prompt-cache", action="store_true",
        help="every system keeps its prompt cache (a request then prefills a few tokens)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    names = [name for name, _ in args.tree]
    names += [BARE] if args.bare else []
    names += [LLAMA_SERVER] if args.llama_server else []
    reference = names[-1]
    columns = [c.format(ref=reference) for c in COLUMNS]
    bursts: list[Burst] = []
    by_model = {}
    for model in args.models:
        mine = uvloop.run(run(args, model))
        bursts += mine
        by_model[model] = cells(mine, names, reference)
    for model, got in by_model.items():
        print(f"\n{model}:{args.branch}, {args.rounds} rounds of {args.seconds:g} s per cell")
        rows = [columns, ["---"] * len(columns), *table(got)]
        print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    out = bench.RESULTS_DIR / f"ab-serving-{time.strftime('%Y-%m-%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"trees": {n: str(s) for n, s in args.tree}, "reference": reference,
              "machine": bench.machine(), "bursts": [asdict(b) for b in bursts]}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", out)
    if args.chart is not None:
        save_chart(by_model, reference, args.chart)
        log.info("wrote %s", args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())

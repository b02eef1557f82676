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
alone and of its workers (psutil: the server's own process, then its children).

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab_serving.py --tree before=/tmp/before/src --tree after=src --bare

The trees run the interpreter and packages of this venv; the worker processes they start
run their tree's code too (the environment carries ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import uvloop

import bench_serving as bench
from servers import Server, free_port
from serving_systems import (
    BARE,
    LLAMA_SERVER,
    HttpSystem,
    Settings,
    Workload,
    bare_gateway_system,
    llama_server_system,
)

log = logging.getLogger("ab_serving")


@dataclass(frozen=True, slots=True)
class Burst:
    system: str
    clients: int
    round: int
    tokens: int
    wall_s: float
    gateway_s: float  # the server's own process
    workers_s: float  # its children


def tree_system(name: str, src: Path, repo: Path, cfg: Settings, logs: Path) -> HttpSystem:
    """``quantroute serve`` from the code in ``src``, with the serving benchmark's flags."""
    port = free_port()
    argv = [
        "env", f"PYTHONPATH={src.resolve()}", sys.executable, "-m", "quantroute.cli", "serve",
        "--repo", str(repo), "--host", "127.0.0.1", "--port", str(port),
        "--engine-parallel", str(cfg.parallel), "--engine-n-threads", str(cfg.threads),
        "--engine-n-ctx", str(cfg.n_ctx), "--server-log-level", "warning",
        "--engine-prompt-cache", "false",
    ]  # fmt: skip
    return HttpSystem(Server(name, argv, port, "/readyz", logs / f"{name}.log"), {}, cfg.parallel)


def split_cpu_s(system: HttpSystem) -> tuple[float, float]:
    """CPU seconds so far of the server's own process and of its children."""
    proc = system.server.proc
    assert proc is not None
    root = psutil.Process(proc.pid)
    own = sum(root.cpu_times()[:2])
    children = 0.0
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = child.cpu_times()
            children += times.user + times.system
    return own, children


async def burst(system: HttpSystem, work: Workload, clients: int, seconds: float, i: int) -> Burst:
    own, children = split_cpu_s(system)
    start = time.perf_counter()
    streams = await bench.closed_loop(system, work, clients, seconds)
    wall = time.perf_counter() - start
    own_after, children_after = split_cpu_s(system)
    tokens = sum(s.tokens for s in streams)
    failed = [s for s in streams if s.error is not None or s.count_error(work.max_tokens)]
    if failed:
        raise SystemExit(f"{system.name}: {len(failed)} stream(s) failed or miscounted")
    return Burst(system.name, clients, i, tokens, wall, own_after - own, children_after - children)


async def run(args: argparse.Namespace) -> list[Burst]:
    repo = bench.model_repo(args.model, None)
    path = bench.model_file(repo, args.model, args.branch)
    cfg = Settings(1, 16, 512, False, 0)
    logs = bench.RESULTS_DIR / "logs" / "ab"
    work = Workload(
        f"{args.model}:{args.branch}", bench.PROMPT, args.max_tokens, bench.eos_id(path), False
    )
    systems = [tree_system(name, src, repo, cfg, logs) for name, src in args.tree]
    if args.bare:
        systems.append(bare_gateway_system(path, cfg, logs))
    if args.llama_server:
        binary = args.llama_server_binary or bench.llama_server_binary()[0]
        systems.append(llama_server_system(binary, path, cfg, logs))
    started: list[HttpSystem] = []
    bursts: list[Burst] = []
    try:
        for system in systems:
            await asyncio.to_thread(system.start, 180.0)
            started.append(system)
            await system.open()
        for system in systems:
            await bench.settle(system)
            await bench.closed_loop(system, work, max(args.clients), 1.0)  # warm-up
        for clients in args.clients:
            for i in range(args.rounds):
                shift = i % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    got = await burst(system, work, clients, args.seconds, i)
                    bursts.append(got)
                    log.info(
                        "%d client(s) round %d %-14s %7.0f tok/s  gateway %6.1f µs/token",
                        clients, i + 1, got.system, got.tokens / got.wall_s,
                        got.gateway_s / max(got.tokens, 1) * 1e6,
                    )  # fmt: skip
    finally:
        for system in reversed(started):
            await system.close()
            await asyncio.to_thread(system.stop)
    return bursts


def table(bursts: list[Burst], names: list[str], reference: str) -> list[list[str]]:
    rows = []
    for clients in sorted({b.clients for b in bursts}):
        mine = {n: [b for b in bursts if b.system == n and b.clients == clients] for n in names}
        ref = {b.round: b.tokens / b.wall_s for b in mine[reference]}
        for name in names:
            cell = mine[name]
            rates = [b.tokens / b.wall_s for b in cell]
            ratios = [b.tokens / b.wall_s / ref[b.round] for b in cell if ref.get(b.round)]
            tokens = sum(b.tokens for b in cell) or 1
            gateway = sum(b.gateway_s for b in cell) / tokens * 1e6
            workers = sum(b.workers_s for b in cell) / tokens * 1e6
            rows.append([
                str(clients), name, f"{statistics.median(rates):.0f}",
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{gateway:.0f}" if name != LLAMA_SERVER else f"({gateway:.0f}, all of it)",
                f"{workers:.0f}" if name != LLAMA_SERVER else "-",
            ])  # fmt: skip
    return rows


COLUMNS = ["Clients", "System", "Aggregate (tok/s)", "/ {ref}, rounds min-max",
           "Gateway CPU per token (µs)", "Workers' CPU per token (µs)"]  # fmt: skip


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
    p.add_argument("--model", default=bench.TINY, choices=[bench.TINY, bench.REALISTIC])
    p.add_argument("--branch", default="q8_0")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=3.0, help="per system, round and cell")
    p.add_argument("--max-tokens", type=int, default=128)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    bursts = uvloop.run(run(args))
    names = [name for name, _ in args.tree]
    names += [BARE] if args.bare else []
    names += [LLAMA_SERVER] if args.llama_server else []
    reference = names[-1]
    rows = table(bursts, names, reference)
    columns = [c.format(ref=reference) for c in COLUMNS]
    print(f"\n{args.model}:{args.branch}, {args.rounds} rounds of {args.seconds:g} s per cell")
    print("\n".join("| " + " | ".join(r) + " |" for r in [columns, ["---"] * 6, *rows]))
    out = bench.RESULTS_DIR / f"ab-serving-{time.strftime('%Y-%m-%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "trees": {n: str(s) for n, s in args.tree},
              "machine": bench.machine(), "bursts": [asdict(b) for b in bursts]}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the observability code costs with tracing off: this tree against a baseline tree.

Both servers are ``bench_gateway``'s (the real app over free ``FakeEngine``
branches, under uvicorn in its own process); only their source differs:
``--baseline-src`` is a checkout without the observability code (say,
``git archive <commit> src | tar -x -C /tmp/base``), the other is this tree
with no ``observability.otlp_endpoint`` (tracing off; metrics and the access
log on, as served by default). Rounds alternate A, B, A, B... so drift on a
shared machine falls on both. Per round, the server process's CPU time:

- per streamed token: ``--streams`` streams of ``--stream-tokens`` tokens;
- per request: ``--requests`` non-streamed one-token completions at ``--rate``/s.

The figure is the median over rounds of each, B against A.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway as bg

ROOT = Path(__file__).resolve().parents[1]


def start(src: Path, port: int) -> subprocess.Popen[bytes]:
    # logs to /dev/null as a service's would go to a collector: their cost is the server's
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.Popen(
        [sys.executable, "-c", bg.SERVER, str(port), "0"],  # no token delay
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def one_round(src: Path, args: argparse.Namespace) -> dict[str, float]:
    port = bg.free_port()
    proc = start(src, port)
    base = f"http://127.0.0.1:{port}"
    try:
        await bg.wait_ready(base)
        cost = await bg.stream_cost(base, proc.pid, args.streams, args.stream_tokens, 8)
        cpu0 = bg.cpu_seconds(proc.pid)
        step = await bg.rate_step(base, args.rate, args.requests / args.rate)
        cpu = bg.cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "cpu_us_per_token": cost["cpu_us_per_token"],
        # the step's 20 warm-up requests ran inside the CPU window too
        "cpu_us_per_request": 1e6 * cpu / (step["requests"] + 20),
        "p50_ms": step["p50_ms"],
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    trees = {"baseline": Path(args.baseline_src), "tracing off": ROOT / "src"}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for i in range(args.rounds):
        for name, src in trees.items():
            r = await one_round(src, args)
            runs[name].append(r)
            print(f"round {i + 1} {name:12s} {json.dumps(r)}", flush=True)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    a, b = med["baseline"], med["tracing off"]
    return {
        "runs": runs,
        "median": med,
        "slower_per_token": b["cpu_us_per_token"] / a["cpu_us_per_token"] - 1,
        "slower_per_request": b["cpu_us_per_request"] / a["cpu_us_per_request"] - 1,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--baseline-src", required=True, help="a src/ without the tracing code")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=200.0)
    result = asyncio.run(main(p.parse_args()))
    bg.RESULTS.mkdir(parents=True, exist_ok=True)
    (bg.RESULTS / "tracing-off.json").write_text(json.dumps(result, indent=1))
    print("\n| server | CPU per streamed token (µs) | CPU per request (µs) | p50 (ms) |")
    print("| --- | ---: | ---: | ---: |")
    for name, m in result["median"].items():
        print(
            f"| {name} | {m['cpu_us_per_token']:.1f} | {m['cpu_us_per_request']:.0f} | "
            f"{m['p50_ms']:.2f} |"
        )
    print(
        f"\ntracing off vs baseline: {result['slower_per_token']:+.1%} per token, "
        f"{result['slower_per_request']:+.1%} per request"
    )

"""The gateway's own cost: request rate at a latency bound, and CPU per streamed token.

The server is the real app (``create_app``: routing, admission, breakers, the
stream store, SSE) in its own process under uvicorn, with ``FakeEngine``
branches that generate for free, so what is measured is the gateway alone.
The load generator is this process, over real loopback sockets.

1. **Rate.** Open-loop arrivals at a fixed rate (one request every 1/rate s,
   whether or not earlier ones are done) for ``--seconds`` per step, at rising
   rates; each request is a non-streamed completion of one token. The highest
   rate whose p99 latency is at most ``--p99-ms`` with zero errors is the
   figure. Latency here is all added latency: the engine costs nothing.
2. **CPU per streamed token.** ``--streams`` streamed completions of
   ``--stream-tokens`` tokens each, ``--concurrency`` at a time; the server
   process's CPU time (user + system, from /proc) over the tokens it streamed,
   counted by each stream's usage chunk (the same rule for every server).
   *Burst*: the fake engine is instant, so the reader lags and the tokens that
   pile up go out together (fewer chunks than tokens; the count is reported).
   *Paced*: the fake engine sends a token every ``--token-ms`` per stream, as a
   decoding engine does, so each token is its own chunk and write. *Floor*: a
   bare ASGI app under the same uvicorn streaming the same events on the same
   timer: what one SSE event per token costs with no gateway at all.

On a 2-core machine the load generator shares the CPU with the server, so the
rate is a floor of what a dedicated client would see; the CPU figure is the
server's own and is not affected by that. Results go to ``--out`` (default
``benchmarks/results/gateway-<date>T<time>.json``, so a second run of the day keeps the
first); ``--markdown`` prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SERVER = r"""
import sys, uvicorn
from pathlib import Path
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision

branches = []
for name in ("f16", "q8_0", "q4_k_m"):
    artifact = BranchArtifact("m", name, Precision(name), "fake", Path(f"/{name}.gguf"), "0" * 64,
                              0, name == "f16")
    engine = FakeEngine(n_ctx=4096)
    engine.token_delay_s = float(sys.argv[2])
    branches.append(Branch("m", name, Precision(name), artifact, engine))
table = RouteTable.build([ModelRoute("m", "f16", tuple(branches))])
settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server={"log_level": "warning"},
                         admission={"queue_size": 4096}, limits={"max_tokens": 4096})
uvicorn.run(create_app(settings, table=table), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning", access_log=False)
"""

# The floor under the paced figure: a bare ASGI app under the same uvicorn that streams the
# same SSE events on the same timer, with no routing, no run, no stream store.
BARE = r"""
import asyncio, json, sys, uvicorn
DELAY = float(sys.argv[2])
CHUNK = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m:q4_k_m",
         "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.body", "body": b"{}"})
        return
    n = json.loads(body)["max_tokens"]
    for i in range(n):
        await asyncio.sleep(DELAY)
        data = json.dumps(CHUNK, separators=(",", ":")).encode()
        await send({"type": "http.response.body", "body": b"id: x/%d\ndata: " % i + data
                    + b"\n\n", "more_body": True})
    usage = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % n
    await send({"type": "http.response.body", "body": usage})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """A process's CPU time (user + system, every thread, exited ones included): its
    scheduler clock on Linux, to the nanosecond, where ``/proc``'s figures count in
    10 ms ticks (a one-client stream of a thousand tokens is only a few ticks)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # Linux: the process's CPUCLOCK_SCHED
    except OSError:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)


async def wait_ready(base: str, timeout_s: float = 60.0) -> None:
    async with httpx.AsyncClient(base_url=base) as c:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if (await c.get("/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the server did not become ready")


async def rate_step(base: str, rate: float, seconds: float) -> dict[str, Any]:
    body = {"model": "m", "prompt": "x", "max_tokens": 1, "quality": "fast"}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as c:

        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                r = await c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    errors += 1
            except httpx.HTTPError:
                errors += 1
            latencies.append(time.perf_counter() - t0)

        for _ in range(20):  # warm the connection pool
            await one()
        latencies.clear()
        errors = 0
        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        achieved = n / (time.perf_counter() - start)
    latencies.sort()
    p = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "rate": rate,
        "achieved_rps": achieved,
        "requests": n,
        "errors": errors,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * p,
    }


async def stream_cost(
    base: str, pid: int, streams: int, tokens: int, concurrency: int
) -> dict[str, Any]:
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "quality": "fast",
    }
    got = chunks = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:

        async def one() -> None:
            nonlocal got, chunks
            async with sem, c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith('data: {"'):
                        continue
                    # tokens counted by the usage chunk: a chunk carries several tokens
                    # when the reader lagged behind the engine
                    if '"usage":{' in line:
                        got += json.loads(line[6:])["usage"]["completion_tokens"]
                    elif '"text":""' not in line:
                        chunks += 1

        await one()  # warm-up
        got = chunks = 0
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    return {
        "streams": streams,
        "tokens": got,
        "chunks": chunks,
        "tokens_per_chunk": got / max(chunks, 1),
        "server_cpu_s": cpu,
        "wall_s": wall,
        "cpu_us_per_token": 1e6 * cpu / max(got, 1),
        "tokens_per_s": got / wall,
    }


def start_server(
    port: int, token_delay_s: float = 0.0, *, bare: bool = False
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    argv = [sys.executable, "-c", BARE if bare else SERVER, str(port), str(token_delay_s)]
    return subprocess.Popen(argv, env=env)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    proc = start_server(port)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(base)
        steps = []
        for rate in args.rates:
            step = await rate_step(base, rate, args.seconds)
            steps.append(step)
            print(
                f"rate {rate:6.0f}/s: achieved {step['achieved_rps']:6.1f}/s, p50 "
                f"{step['p50_ms']:.2f} ms, p99 {step['p99_ms']:.2f} ms, errors {step['errors']}",
                flush=True,
            )
        ok = [s for s in steps if s["p99_ms"] <= args.p99_ms and s["errors"] == 0]
        burst = await stream_cost(
            base, proc.pid, args.streams, args.stream_tokens, args.concurrency
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report("burst (the engine is instant; the reader lags)", burst)
    # Paced: a token every --token-ms per stream, as a decoding engine sends them, so the
    # reader keeps up and each token is its own chunk: the per-token cost with no batching.
    paced = await paced_cost(args, bare=False)
    report(f"paced (a token every {args.token_ms:g} ms per stream)", paced)
    floor = await paced_cost(args, bare=True)
    report("floor (a bare ASGI app, same uvicorn, same timer and events)", floor)
    return {
        "date": dt.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "p99_bound_ms": args.p99_ms,
        "steps": steps,
        "highest_rate_within_bound": max((s["rate"] for s in ok), default=None),
        "stream_cost": burst,
        "paced_stream_cost": paced | {"token_ms": args.token_ms},
        "paced_floor": floor | {"token_ms": args.token_ms},
    }


async def paced_cost(args: argparse.Namespace, *, bare: bool) -> dict[str, Any]:
    """The paced load against a fresh server: quantroute's, or the bare ASGI floor."""
    port = free_port()
    proc = start_server(port, args.token_ms / 1000, bare=bare)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(base)
        return await stream_cost(
            base, proc.pid, args.paced_streams, args.stream_tokens, args.paced_concurrency
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def report(what: str, cost: dict[str, Any]) -> None:
    print(
        f"{what}: {cost['tokens']} tokens in {cost['chunks']} chunks, "
        f"{cost['cpu_us_per_token']:.1f} us of server CPU per token "
        f"({cost['tokens_per_s']:.0f} tokens/s)",
        flush=True,
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--rates", type=float, nargs="+", default=[50, 100, 200, 300, 400, 500, 600, 800]
    )
    p.add_argument("--seconds", type=float, default=5.0, help="per rate step")
    p.add_argument("--p99-ms", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--token-ms", type=float, default=2.0, help="the paced engine's token gap")
    p.add_argument("--paced-streams", type=int, default=64)
    p.add_argument("--paced-concurrency", type=int, default=16)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/...)")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    result = asyncio.run(main(args))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M%S")
    out = args.out or RESULTS / f"gateway-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if args.markdown:
        print("\n| offered rate (req/s) | achieved | p50 (ms) | p99 (ms) | errors |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for s in result["steps"]:
            print(
                f"| {s['rate']:.0f} | {s['achieved_rps']:.1f} | {s['p50_ms']:.2f} | "
                f"{s['p99_ms']:.2f} | {s['errors']} |"
            )
    print(f"results: {out}")

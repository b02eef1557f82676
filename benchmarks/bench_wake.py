"""What a wake from idle costs: the floor under a one-client gateway's CPU per token.

At one client a streaming gateway sleeps between tokens: the worker decodes for
hundreds of microseconds, then one line on its pipe wakes the gateway, which
writes one chunk and sleeps again. So each token pays a wake from idle, and
the code that runs after it runs with cold caches. This measures both, on the
machine it runs on, at token gaps of ``--gaps`` ms:

1. **A bare wake**, the CPU time of the woken process per wake (its own
   ``process_time``; the waker is another process, so its cost is not counted):
   - ``sleep``: ``time.sleep(gap)``, a timer wake with no event loop;
   - ``pipe``: a blocking ``read`` of a pipe another process writes a byte to
     every ``gap``: the worker-to-gateway pattern, no event loop;
   - ``uvloop``: the same pipe read by a uvloop event loop (``connect_read_pipe``
     and a protocol): a gateway process that wakes and does nothing else.
2. **One stream, paced**: ``bench_gateway.py``'s paced load with one client
   (one token every ``gap`` from the fake engine, so one chunk and one write per
   token), against quantroute and against the bare ASGI floor (the same uvicorn,
   the same events, no gateway): the server's CPU per token.
3. **The first token's path, warm and after idle**, in-process (the real app over
   fake engines, raw ASGI calls, no sockets): the time from the engine's first
   token to the response's head, when the first token comes at once and when it
   comes ``--prefill-ms`` later, as a worker's prefill does. The same code runs
   in both; only the idle gap before it differs.

    python benchmarks/bench_wake.py [--markdown] [--plot docs/img/bench_wake.png]

Results go to ``--out`` (default ``benchmarks/results/wake-<date>T<time>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import uvloop

from quantroute.telemetry.cpu import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway  # a sibling script: the paced load and its floor

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# writes one byte to its stdout every GAP seconds, N times, on an absolute schedule
WAKER = r"""
import os, sys, time
gap, n = float(sys.argv[1]), int(sys.argv[2])
due = time.perf_counter()
for _ in range(n):
    due += gap
    pause = due - time.perf_counter()
    if pause > 0:
        time.sleep(pause)
    os.write(1, b"x")
"""


def _waker(gap_s: float, n: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WAKER, str(gap_s), str(n)], stdout=subprocess.PIPE
    )


def wake_sleep(gap_s: float, n: int) -> float:
    """CPU µs per ``time.sleep(gap_s)``."""
    t0 = time.process_time()
    for _ in range(n):
        time.sleep(gap_s)
    return 1e6 * (time.process_time() - t0) / n


def wake_pipe(gap_s: float, n: int) -> float:
    """CPU µs per blocking one-byte read of a pipe written every ``gap_s``."""
    proc = _waker(gap_s, n)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.read(fd, 1)  # the waker is up
    t0 = time.process_time()
    got = 0
    while got < n - 1 and os.read(fd, 1):
        got += 1
    cpu = time.process_time() - t0
    proc.wait()
    return 1e6 * cpu / max(got, 1)


def wake_uvloop(gap_s: float, n: int) -> float:
    """CPU µs per wake of a uvloop loop reading a pipe written every ``gap_s``."""

    async def main() -> float:
        proc = _waker(gap_s, n)
        assert proc.stdout is not None
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        seen = [0, 0, 0.0]  # bytes, wakes, the CPU clock at the first

        class Reader(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                if seen[0] == 0:
                    seen[2] = time.process_time()  # from the first byte on
                seen[0] += len(data)
                seen[1] += 1
                if seen[0] >= n and not done.done():
                    done.set_result(None)

            def connection_lost(self, exc: Exception | None) -> None:
                if not done.done():
                    done.set_result(None)

        await loop.connect_read_pipe(Reader, proc.stdout)
        await done
        cpu = time.process_time() - seen[2]
        await asyncio.to_thread(proc.wait)
        return 1e6 * cpu / max(seen[1] - 1, 1)

    return uvloop.run(main())


def bare_wakes(gaps_ms: list[float], seconds: float, rounds: int) -> dict[str, dict[str, Any]]:
    """Part 1: the median over ``rounds`` of each kind of wake's CPU, per gap."""
    kinds = {"sleep": wake_sleep, "pipe": wake_pipe, "uvloop": wake_uvloop}
    out: dict[str, dict[str, Any]] = {k: {} for k in kinds}
    for gap in gaps_ms:
        n = max(50, int(seconds / (gap / 1000)))
        for kind, fn in kinds.items():
            runs = [fn(gap / 1000, n) for _ in range(rounds)]
            out[kind][str(gap)] = {"median_us": statistics.median(runs), "runs_us": runs}
            print(
                f"wake  {kind:6s} every {gap:g} ms: {statistics.median(runs):6.1f} us CPU",
                flush=True,
            )
    return out


async def one_stream(gaps_ms: list[float], tokens: int, streams: int) -> dict[str, dict[str, Any]]:
    """Part 2: one client's paced stream, quantroute and the floor, per gap."""
    out: dict[str, dict[str, Any]] = {"quantroute": {}, "floor": {}}
    for gap in gaps_ms:
        args = SimpleNamespace(
            token_ms=gap, paced_streams=streams, stream_tokens=tokens, paced_concurrency=1
        )
        for name, bare in (("quantroute", False), ("floor", True)):
            cost = await bench_gateway.paced_cost(args, bare=bare)  # type: ignore[arg-type]
            out[name][str(gap)] = cost
            print(
                f"paced {name:10s} every {gap:g} ms: {cost['cpu_us_per_token']:6.1f} us of "
                f"server CPU per token ({cost['tokens']} tokens, {cost['chunks']} chunks)",
                flush=True,
            )
    return out


def first_token_path(prefill_ms: float, requests: int, rounds: int) -> dict[str, Any]:
    """Part 3: the engine's first token to the head, in-process, warm and after idle."""
    sys.path.insert(0, str(ROOT / "tests"))
    from qrtest import fake_table
    from quantroute.api.app import create_app
    from quantroute.config import load_settings
    from quantroute.engines.base import GenerationRequest, StartEvent, TokenEvent
    from quantroute.engines.fake import FakeEngine

    marks: dict[str, int] = {}
    clock = time.perf_counter_ns
    hold = [0.0]

    class Held(FakeEngine):
        async def generate(self, request: GenerationRequest) -> Any:
            async for event in super().generate(request):
                if isinstance(event, StartEvent) and hold[0]:
                    await asyncio.sleep(hold[0])  # the worker's prefill: the gateway idles
                if isinstance(event, TokenEvent) and "token" not in marks:
                    marks["token"] = clock()
                yield event

    body = json.dumps(
        {"model": "tiny-llama", "prompt": "hi " * 40, "max_tokens": 8, "stream": True}
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"localhost")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }

    async def request(app: Any) -> None:
        asked = False

        async def receive() -> dict[str, Any]:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # no disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                marks["head"] = clock()
            elif message.get("body") and "body" not in marks:
                marks["body"] = clock()

        marks.clear()
        await app(dict(scope), receive, send)

    async def main() -> dict[str, list[float]]:
        settings = load_settings(
            telemetry={"devices": "sim:1x24GiB"},
            server={"log_level": "warning"},
            observability={"access_log": False},
            limits={"max_tokens": 64},
        )
        engines = {n: Held(text="hello, world. " * 4) for n in ("f16", "q8_0", "q4_k_m")}
        app = create_app(settings, fake_table(engines))
        spans: dict[str, list[float]] = {"warm": [], "after_idle": []}
        async with app.router.lifespan_context(app):
            for _ in range(200):  # warm-up
                await request(app)
            for _ in range(rounds):  # the two cases alternate
                for case, gap in (("warm", 0.0), ("after_idle", prefill_ms / 1000)):
                    hold[0] = gap
                    times = []
                    for _ in range(requests):
                        await request(app)
                        times.append((marks["head"] - marks["token"]) / 1000)
                    spans[case].append(statistics.median(times))
        return spans

    spans = uvloop.run(main())
    warm, idle = statistics.median(spans["warm"]), statistics.median(spans["after_idle"])
    print(
        f"first token to head: {warm:.1f} us warm, {idle:.1f} us after {prefill_ms:g} ms idle "
        f"({idle / warm:.2f}x)",
        flush=True,
    )
    return {
        "prefill_ms": prefill_ms,
        "warm_us": warm,
        "after_idle_us": idle,
        "ratio": idle / warm,
        "rounds_us": spans,
    }


def markdown(result: dict[str, Any]) -> str:
    gaps = [str(g) for g in result["gaps_ms"]]
    head = "| | " + " | ".join(f"every {g} ms" for g in gaps) + " |"
    rule = "| --- |" + " ---: |" * len(gaps)
    lines = ["CPU µs per wake, the woken process's own (medians):", "", head, rule]
    names = {
        "sleep": "`time.sleep` (a timer)",
        "pipe": "a blocking pipe read",
        "uvloop": "a uvloop loop woken by a pipe",
    }
    for kind, label in names.items():
        row = result["wakes"][kind]
        lines.append(
            f"| {label} | " + " | ".join(f"{row[g]['median_us']:.1f}" for g in gaps) + " |"
        )
    lines += ["", "One client's paced stream, server CPU µs per token:", "", head, rule]
    for name in ("quantroute", "floor"):
        row = result["one_stream"][name]
        label = "quantroute" if name == "quantroute" else "floor: a bare ASGI app"
        cells = " | ".join(f"{row[g]['cpu_us_per_token']:.1f}" for g in gaps)
        lines.append(f"| {label} | {cells} |")
    ft = result["first_token"]
    lines += [
        "",
        f"The first token to the head, in-process: {ft['warm_us']:.1f} µs warm, "
        f"{ft['after_idle_us']:.1f} µs after {ft['prefill_ms']:g} ms idle ({ft['ratio']:.2f}x).",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = result["gaps_ms"]
    keys = [str(g) for g in gaps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, label in (
        ("sleep", "time.sleep"),
        ("pipe", "blocking pipe read"),
        ("uvloop", "uvloop, woken by a pipe"),
    ):
        left.plot(gaps, [result["wakes"][kind][k]["median_us"] for k in keys], "o-", label=label)
    left.set(xscale="log", xlabel="gap between wakes (ms)", ylabel="CPU µs per wake")
    left.set_title("A wake from idle, nothing else")
    for name, label in (("quantroute", "quantroute"), ("floor", "bare ASGI app (floor)")):
        values = [result["one_stream"][name][k]["cpu_us_per_token"] for k in keys]
        right.plot(gaps, values, "o-", label=label)
    right.axhline(20, color="grey", linestyle=":", label="goal: 20 µs per token")
    right.set(xscale="log", xlabel="gap between tokens (ms)", ylabel="server CPU µs per token")
    right.set_title("One client, one chunk per token")
    for ax in (left, right):
        ax.set_xticks(gaps, [f"{g:g}" for g in gaps])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Cost of idling between tokens ({result['date']}, {result['machine']['cpu']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gaps", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--seconds", type=float, default=1.0, help="per bare-wake measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=4, help="one-client streams per gap")
    p.add_argument("--prefill-ms", type=float, default=5.0)
    p.add_argument("--first-token-requests", type=int, default=300)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--plot", type=Path, help="write the chart here (PNG)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "gaps_ms": args.gaps,
        "wakes": bare_wakes(args.gaps, args.seconds, args.rounds),
        "one_stream": asyncio.run(one_stream(args.gaps, args.stream_tokens, args.streams)),
        "first_token": first_token_path(args.prefill_ms, args.first_token_requests, args.rounds),
    }
    out = args.out or RESULTS / f"wake-{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    if args.markdown:
        print(markdown(result))
    if args.plot is not None:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

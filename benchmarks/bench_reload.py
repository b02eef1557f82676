"""Hot reload: swap time (the rename to the new version serving) and latency meanwhile.

A repository of one model with one branch (tiny-llama's Q4_K_M file, one
llama.cpp worker, 1 thread) is served by the real app in this process. A
steady closed-loop load of ``--clients`` clients sends non-streamed
completions of ``--tokens`` tokens back to back. After ``--warm-s`` seconds
of baseline, the branch's file is replaced the way an operator does it (write
``main.gguf.tmp``, rename it onto ``main.gguf``, then the manifest the same
way), and the reload is triggered by the repository watcher (``--trigger
watch``, debounced ``--debounce-ms``) or by ``POST /admin/reload``
(``--trigger admin``). Reported:

- **swap time**: from the rename to the first response answered by the new
  file (its ``x-quantroute-artifact`` header), and its parts: the debounce,
  checks (sha256, signature, GGUF header in its child process), starting and
  warming up the new worker, the reference swap; then the drain of the old
  worker;
- **latency** of the requests that ran in the baseline window and of those
  that overlapped the reload (from the rename to the old worker stopped):
  p50, p99, max, errors.

The load generator, the gateway and both workers share the machine's cores,
so the latency impact includes the new worker's load and warm-up competing
for CPU with the old one's decoding. ``--rounds`` repeats the replacement
(alternating Q8_0 and Q4_K_M files); ``--markdown`` prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from quantroute.api.app import create_app
from quantroute.config import DEMO_REPO, load_settings
from quantroute.registry.manifest import sha256_file

MODEL = "tiny-llama"
ADMIN = {"authorization": "Bearer bench-admin"}


def _manifest(folder: Path, precision: str) -> None:
    body = {
        "model": MODEL,
        "reference": "main",
        "branches": {
            "main": {
                "file": "main.gguf",
                "precision": precision,
                "sha256": sha256_file(folder / "main.gguf"),
            }
        },
    }
    tmp = folder / "quantroute.yaml.tmp"
    tmp.write_text(yaml.safe_dump(body, sort_keys=False))
    tmp.replace(folder / "quantroute.yaml")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="qr-bench-reload-"))
    folder = root / "repo" / MODEL
    folder.mkdir(parents=True)
    demo = DEMO_REPO / MODEL
    shutil.copyfile(demo / "q4_k_m.gguf", folder / "main.gguf")
    _manifest(folder, "q4_k_m")
    settings = load_settings(
        repo=root / "repo",
        telemetry={"devices": "cpu"},
        server={"admin_key": "bench-admin", "log_level": "warning"},
        engine={"n_ctx": 256, "parallel": 4, "n_threads": 1},
        repository={
            "watch": args.trigger == "watch",
            "watch_debounce_ms": args.debounce_ms,
            "drain_quiet_s": 0.2,
        },
    )
    app = create_app(settings)
    rows = []
    async with app.router.lifespan_context(app):
        gateway = app.state.gateway
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://qr", timeout=60) as c:
            samples: list[tuple[float, float, str, bool]] = []  # start, end, artifact, ok
            stop = asyncio.Event()
            body = {"model": MODEL, "prompt": "def ", "max_tokens": args.tokens}
            body |= {"temperature": 0, "ignore_eos": True}

            async def client() -> None:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        r = await c.post("/v1/completions", json=body)
                        ok = r.status_code == 200
                        artifact = r.headers.get("x-quantroute-artifact", "")
                    except httpx.HTTPError:
                        ok, artifact = False, ""
                    samples.append((t0, time.monotonic(), artifact, ok))

            swapped = asyncio.Event()  # told by the reloader's hook (where metrics hang too)
            gateway.reloader.hooks.append(
                lambda report: swapped.set() if report.outcome == "swapped" else None
            )
            load = [asyncio.create_task(client()) for _ in range(args.clients)]
            sources = ["q8_0", "q4_k_m"]
            for n in range(args.rounds):
                await asyncio.sleep(args.warm_s)
                source = sources[n % 2]
                data = (demo / f"{source}.gguf").read_bytes()
                (folder / "main.gguf.tmp").write_bytes(data)
                swapped.clear()
                renamed = time.monotonic()
                (folder / "main.gguf.tmp").replace(folder / "main.gguf")
                _manifest(folder, source)
                new = sha256_file(folder / "main.gguf")[:16]
                if args.trigger == "admin":
                    await c.post("/admin/reload", headers=ADMIN)
                await swapped.wait()
                report = gateway.reloader.last
                assert report is not None
                drained = time.monotonic()
                await asyncio.sleep(1.0)
                served = min(
                    (end for start, end, a, ok in samples if a == new and start >= renamed),
                    default=float("nan"),
                )
                base = [e - s for s, e, _, ok in samples if renamed - args.warm_s <= s < renamed]
                during = [e - s for s, e, _, _ in samples if s < drained and e > renamed]
                errors = sum(1 for s, e, _, ok in samples if not ok and e > renamed - args.warm_s)
                rows.append(
                    {
                        "round": n + 1,
                        "file": source,
                        "swap_s": served - renamed,
                        "checks_s": report.check_s,
                        "to_swap_s": report.swap_s,
                        "reload_s": report.duration_s,
                        "base_p50_ms": 1000 * statistics.median(base),
                        "base_p99_ms": 1000 * _pct(base, 0.99),
                        "during_p50_ms": 1000 * statistics.median(during),
                        "during_p99_ms": 1000 * _pct(during, 0.99),
                        "during_max_ms": 1000 * max(during),
                        "requests_during": len(during),
                        "errors": errors,
                    }
                )
            stop.set()
            await asyncio.gather(*load)
    shutil.rmtree(root, ignore_errors=True)
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "| round | new file | rename → new serving (s) | reload: checks / to swap / with "
        "drain (s) | baseline p50 / p99 (ms) | during p50 / p99 / max (ms) | requests "
        "during | errors |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['file']} | {r['swap_s']:.3f} | {r['checks_s']:.3f} / "
            f"{r['to_swap_s']:.3f} / {r['reload_s']:.3f} | {r['base_p50_ms']:.1f} / "
            f"{r['base_p99_ms']:.1f} | {r['during_p50_ms']:.1f} / {r['during_p99_ms']:.1f} / "
            f"{r['during_max_ms']:.1f} | {r['requests_during']} | {r['errors']} |"
        )
    lines.append(
        f"\n_{dt.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; trigger {args.trigger}"
        + (f" (debounce {args.debounce_ms} ms)" if args.trigger == "watch" else "")
        + f"; {args.clients} clients, {args.tokens} tokens per request._"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trigger", choices=("watch", "admin"), default="watch")
    parser.add_argument("--debounce-ms", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = asyncio.run(run(args))
    if args.markdown:
        print(markdown(rows, args))
    else:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()

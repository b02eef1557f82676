"""ONNX Runtime branches beside the GGUF branches of the same model: TTFT and decode tok/s.

Run from the repository root::

    nice -n 10 .venv/bin/python benchmarks/bench_onnx.py [--model tiny|bpe ...] [--chart PNG]

For each demo model (``tiny``: the packaged tiny-llama; ``bpe``: stdlib-bpe-llama, built
once into the cache), the ONNX folders are exported from its ``f16.gguf`` (f32, f16,
int8, int4: ``quantroute.demo.onnx_export``) and every branch, ONNX and GGUF, is served by
the same worker class through ``LlamaCppEngine`` (ONNX: ``--backend onnx``): 1 thread,
4 slots, ``n_ctx`` 512, prompt cache off, one branch at a time (they would share the
cores). A run is C concurrent greedy generations of MAX_TOKENS tokens (end of sequence
ignored) after a 201-character prompt; TTFT is from ``generate()`` to the first token,
per stream; decode tok/s is ``(tokens - 1) / (last - first)`` per stream, and the total
is every stream's tokens over the wall time from the first first token to the last
token. Medians of ``--repeats`` runs after one warm run. One line per branch shows the
progress; the JSON goes to ``benchmarks/results/onnx-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from qrtest import demo_model_dir, realistic_repo
from quantroute.demo.onnx_export import GgufSource, export_onnx
from quantroute.engines.base import GenerationRequest, SamplingParams, TokenEvent
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy

MAX_TOKENS = 128
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n" * 5)[:200]
CONCURRENCY = (1, 4)
ONNX = ("f32", "f16", "int8", "int4")
GGUF = ("f16", "q8_0", "q4_k_m")
ROOT = Path(__file__).resolve().parents[1]

Stats = dict[str, float]


async def one(engine: LlamaCppEngine, i: int) -> tuple[float, float, float, int]:
    """One greedy generation: when it was asked, its first and last token, and how many."""
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = []
    async for event in engine.generate(GenerationRequest(f"b{i}", PROMPT, sampling)):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
    return t0, stamps[0], stamps[-1], len(stamps)


async def measure(engine: LlamaCppEngine, clients: int, repeats: int) -> Stats:
    runs = []
    for r in range(repeats + 1):
        res = await asyncio.gather(*(one(engine, i) for i in range(clients)))
        if r == 0:
            continue  # warm
        ttft = statistics.median(first - t0 for t0, first, _, _ in res)
        per = statistics.median((n - 1) / (last - first) for _, first, last, n in res)
        wall = max(last for _, _, last, _ in res) - min(first for _, first, _, _ in res)
        runs.append((ttft, per, sum(n - 1 for *_, n in res) / wall))
    return {
        "ttft_ms": 1000 * statistics.median(r[0] for r in runs),
        "tok_s_per_stream": statistics.median(r[1] for r in runs),
        "tok_s_total": statistics.median(r[2] for r in runs),
    }


def engines(model_dir: Path, scratch: Path) -> dict[str, LlamaCppEngine]:
    """Every branch of the model, ONNX (exported here) and GGUF, as engines not started."""
    source = GgufSource.read(model_dir / "f16.gguf")
    policy = RestartPolicy(backoff_s=0.2)
    made: dict[str, LlamaCppEngine] = {}
    for precision in ONNX:
        folder = scratch / f"onnx_{precision}"
        export_onnx(source, folder, precision)
        options = WorkerOptions(backend="onnx", parallel=4, n_threads=1, n_ctx=512,
                                prompt_cache=False)  # fmt: skip
        made[f"onnx_{precision}"] = LlamaCppEngine(
            precision, folder / "model.onnx", options, policy, tokenizer=folder / "tokenizer.gguf"
        )
    for name in GGUF:
        options = WorkerOptions(parallel=4, n_threads=1, n_ctx=512, prompt_cache=False)
        made[f"gguf_{name}"] = LlamaCppEngine(name, model_dir / f"{name}.gguf", options, policy)
    return made


async def run_model(model: str, repeats: int) -> dict[str, dict[str, Stats]]:
    model_dir = demo_model_dir() if model == "tiny" else realistic_repo() / "stdlib-bpe-llama"
    results: dict[str, dict[str, Stats]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-onnx.") as scratch:
        for name, engine in engines(model_dir, Path(scratch)).items():
            await engine.start()
            if not engine.ready:
                raise SystemExit(f"{model} {name}: {engine.failure}")
            try:
                results[name] = {f"c{c}": await measure(engine, c, repeats) for c in CONCURRENCY}
            finally:
                await engine.stop()
            c1, c4 = results[name]["c1"], results[name]["c4"]
            print(f"{model} {name}: TTFT {c1['ttft_ms']:.1f} ms, {c1['tok_s_per_stream']:.0f} "
                  f"tok/s alone; 4 clients {c4['tok_s_total']:.0f} tok/s", flush=True)  # fmt: skip
    return results


def markdown(model: str, results: dict[str, dict[str, Stats]]) -> str:
    lines = [
        f"| {model} branch | TTFT, 1 client (ms) | tok/s, 1 client | TTFT, 4 clients (ms) "
        "| tok/s per stream, 4 clients | tok/s total, 4 clients |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        a, b = r["c1"], r["c4"]
        lines.append(
            f"| {name} | {a['ttft_ms']:.1f} | {a['tok_s_per_stream']:.0f} | {b['ttft_ms']:.1f} "
            f"| {b['tok_s_per_stream']:.0f} | {b['tok_s_total']:.0f} |"
        )
    return "\n".join(lines)


def save_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        results = report["models"][model]
        names = list(results)
        colors = ["tab:orange" if n.startswith("onnx") else "tab:blue" for n in names]
        for col, (key, label) in enumerate(
            [("ttft_ms", "TTFT, 1 client (ms)"), ("tok_s_total", "tok/s, 4 clients together")]
        ):
            ax = axes[row][col]
            c = "c1" if key == "ttft_ms" else "c4"
            ax.bar(names, [results[n][c][key] for n in names], color=colors)
            ax.set_title(f"{model}: {label}")
            ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"ONNX Runtime (orange) beside GGUF (blue) branches, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=("tiny", "bpe"), default=["tiny", "bpe"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chart", type=Path, default=None, help="write the plot here")
    args = parser.parse_args(argv)
    now = datetime.now(UTC)
    report: dict[str, Any] = {"date": now.strftime("%Y-%m-%d"), "models": {}}
    for model in args.model:
        report["models"][model] = asyncio.run(run_model(model, args.repeats))
        print(markdown(model, report["models"][model]), flush=True)
    out = ROOT / "benchmarks" / "results" / f"onnx-{now:%Y-%m-%dT%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    if args.chart is not None:
        save_chart(report, args.chart)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

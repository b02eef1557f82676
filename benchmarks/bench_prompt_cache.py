"""Prompt caching: time to first token of a prompt that shares a long prefix with an
earlier one (warm) against one whose prefix was never seen (cold).

For each branch a real llama.cpp worker (``LlamaCppEngine``, 1 thread, ``parallel`` 2)
serves ``--rounds`` rounds; each round sends a cold prompt (a fresh ~450-token
prefix and a question) and then a warm one (the same prefix, another question),
and the same warm prompt to a second worker with ``prompt_cache`` off, whose text
must be identical (greedy). TTFT is measured by the engine's caller: from
``generate`` to the first token, over the worker's pipe. ``--api`` also measures
the realistic Q8_0 branch through the real app (in-process ASGI, non-streamed,
``max_tokens`` 1: the response time is the TTFT plus the gateway).

    PYTHONPATH=src:tests python benchmarks/bench_prompt_cache.py --rounds 7 --api
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from qrtest import demo_model_dir, realistic_repo
from quantroute.engines.base import (
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy

CODE = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"


def prefix(model: str, i: int) -> str:
    """A prefix of 400+ tokens never seen before round ``i``."""
    body = CODE * 24 if model == "stdlib-bpe-llama" else CODE * 8  # BPE vs byte tokens
    return f"# module {i}\n" + body


async def first_token(engine: LlamaCppEngine, prompt: str) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, reused tokens, text) of one greedy 8-token generation."""
    request = GenerationRequest("b", prompt, SamplingParams(max_tokens=8, temperature=0))
    t0, ttft, pt, reused, text = time.perf_counter(), 0.0, 0, 0, []
    async for ev in engine.generate(request):
        if isinstance(ev, StartEvent):
            pt, reused = ev.prompt_tokens, ev.cached_tokens
        elif isinstance(ev, TokenEvent):
            ttft = ttft or time.perf_counter() - t0
            text.append(ev.text)
    return ttft, pt, reused, "".join(text)


def engine(path: Path, cache: bool) -> LlamaCppEngine:
    options = WorkerOptions(parallel=2, n_threads=1, prompt_cache=cache)
    return LlamaCppEngine(f"bench:{path.stem}", path, options, RestartPolicy())


async def bench_branch(model: str, path: Path, rounds: int) -> dict[str, Any]:
    on, off = engine(path, True), engine(path, False)
    await asyncio.gather(on.start(), off.start())
    cold_s, warm_s, reused, prompt, same = [], [], [], [], True
    try:
        for i in range(rounds):
            p = prefix(model, i)
            cold_s.append((await first_token(on, p + "\nclass Alpha:\n"))[0])
            ttft, pt, hit, text = await first_token(on, p + "\nclass Beta:\n")
            warm_s.append(ttft)
            prompt.append(pt)
            reused.append(hit)
            same &= text == (await first_token(off, p + "\nclass Beta:\n"))[3]
    finally:
        await asyncio.gather(on.stop(), off.stop())
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    return {
        "model": model,
        "branch": path.stem,
        "prompt_tokens": statistics.median(prompt),
        "reused_tokens": statistics.median(reused),
        "cold_ms": cold * 1e3,
        "warm_ms": warm * 1e3,
        "ratio": cold / warm,
        "identical_text": same,
    }


async def bench_api(rounds: int) -> dict[str, Any]:
    """The realistic Q8_0 branch through the real app: 1-token completions."""
    import httpx

    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        shutil.copytree(realistic_repo() / "stdlib-bpe-llama", repo / "stdlib-bpe-llama")
        settings = load_settings(repo=repo, engine={"parallel": 2, "n_threads": 1})
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qr") as c:

                async def once(prompt: str) -> tuple[float, int]:
                    body = {"model": "stdlib-bpe-llama:q8_0", "prompt": prompt}
                    body |= {"max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    r = await c.post("/v1/completions", json=body, timeout=60)
                    r.raise_for_status()
                    details = r.json()["usage"]["prompt_tokens_details"]
                    return time.perf_counter() - t0, int(details["cached_tokens"])

                cold_s, warm_s, cached = [], [], []
                for i in range(rounds):
                    p = prefix("stdlib-bpe-llama", 100 + i)
                    cold_s.append((await once(p + "\nclass Alpha:\n"))[0])
                    ttft, hit = await once(p + "\nclass Beta:\n")
                    warm_s.append(ttft)
                    cached.append(hit)
    cold, warm = statistics.median(cold_s), statistics.median(warm_s)
    return {
        "cold_ms": cold * 1e3,
        "warm_ms": warm * 1e3,
        "ratio": cold / warm,
        "cached_tokens": statistics.median(cached),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--api", action="store_true", help="also through the real app")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prompt_cache.json"))
    args = parser.parse_args()
    realistic = realistic_repo() / "stdlib-bpe-llama"
    targets = [("stdlib-bpe-llama", realistic / f"{b}.gguf") for b in ("f16", "q8_0", "q4_k_m")]
    targets.append(("tiny-llama", demo_model_dir() / "q8_0.gguf"))
    rows = [await bench_branch(model, path, args.rounds) for model, path in targets]
    head = ("model", "branch", "prompt tokens", "reused", "cold TTFT (ms)", "warm TTFT (ms)")
    print("| " + " | ".join((*head, "ratio", "text")) + " |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['branch']} | {r['prompt_tokens']:.0f} | {r['reused_tokens']:.0f} "
            f"| {r['cold_ms']:.1f} | {r['warm_ms']:.1f} | {r['ratio']:.1f}x "
            f"| {'identical' if r['identical_text'] else 'DIFFERENT'} |"
        )
    api = await bench_api(args.rounds) if args.api else None
    if api is not None:
        print(
            f"\nthrough the app (stdlib-bpe-llama:q8_0, 1-token completions): cold "
            f"{api['cold_ms']:.1f} ms, warm {api['warm_ms']:.1f} ms, {api['ratio']:.1f}x, "
            f"cached_tokens {api['cached_tokens']:.0f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": dt.date.today().isoformat(),
                "machine": platform.processor() or platform.machine(),
                "rows": rows,
                "api": api,
            },
            indent=2,
        )
    )
    if not all(r["identical_text"] for r in rows):
        raise SystemExit("the cached and uncached workers' texts differ")


if __name__ == "__main__":
    asyncio.run(main())

"""What constrained decoding costs per token, in the llama.cpp worker.

One ``LlamaCppEngine`` (one sequence, one thread) per model; each rep generates
``--tokens`` tokens at temperature 1 three ways: free (``ignore_eos``), with
``response_format: json_object``, and with a JSON schema (an object of eight
properties). Grammar runs have no ``ignore_eos``: they may end early, so the
figure is wall time per *generated* token, medians over ``--reps``. The extra
time per token is the grammar's mask over the whole vocabulary plus the
closing-path check (``engines/constrained.py``).

Models: the packaged ``tiny-llama`` (354 tokens) and, when its demo build is cached,
``stdlib-bpe-llama`` (32,000 tokens), where the mask's cost shows.

Run::

    PYTHONPATH=src python benchmarks/bench_grammar.py [--tokens 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import statistics
import time
from pathlib import Path

from quantroute.engines.base import FinishEvent, GenerationRequest, SamplingParams
from quantroute.engines.grammar import json_object_grammar, schema_grammar
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b", "c"]},
        "ok": {"type": "boolean"},
        "score": {"type": "number"},
        "owner": {"type": "object", "properties": {"id": {"type": "string"}}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "tags", "kind", "ok", "score", "owner", "note"],
    "additionalProperties": False,
}


def _models() -> list[tuple[str, Path]]:
    from quantroute.config import DEMO_REPO

    models = [("tiny-llama q8_0", DEMO_REPO / "tiny-llama" / "q8_0.gguf")]
    cache = Path.home() / ".cache" / "quantroute" / "demo"
    for found in sorted(cache.glob("stdlib-bpe-llama-*/stdlib-bpe-llama/q8_0.gguf")):
        models.append(("stdlib-bpe-llama q8_0", found))
        break
    return models


async def _ms_per_token(engine: LlamaCppEngine, sampling: SamplingParams, reps: int) -> float:
    times = []
    for rep in range(reps + 1):
        request = GenerationRequest(f"b{rep}", "def ", SamplingParams(**{
            **{f: getattr(sampling, f) for f in sampling.__slots__}, "seed": rep}))  # fmt: skip
        start = time.perf_counter()
        tokens = 0
        async for event in engine.generate(request):
            if isinstance(event, FinishEvent):
                tokens = event.completion_tokens
        if rep and tokens:  # the first rep warms up
            times.append((time.perf_counter() - start) * 1000 / tokens)
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{dt.date.today()}  {platform.processor() or platform.machine()}  1 thread")
    print(f"{'model':24} {'free ms/tok':>12} {'json_object':>12} {'schema':>12}")
    for name, path in _models():
        engine = LlamaCppEngine(
            name, path, WorkerOptions(parallel=1, n_threads=1, n_ctx=1024), RestartPolicy()
        )
        await engine.start()
        base = SamplingParams(max_tokens=args.tokens, temperature=1.0)
        free = await _ms_per_token(
            engine, SamplingParams(max_tokens=args.tokens, ignore_eos=True), args.reps
        )
        cells = [free]
        for grammar in (json_object_grammar(), schema_grammar(SCHEMA)):
            sampling = SamplingParams(max_tokens=base.max_tokens, grammar=grammar)
            cells.append(await _ms_per_token(engine, sampling, args.reps))
        await engine.stop()
        row = "  ".join(f"{c:8.3f} (+{c - free:.3f})" if i else f"{c:12.3f}"
                        for i, c in enumerate(cells))  # fmt: skip
        print(f"{name:24} {row}")


if __name__ == "__main__":
    asyncio.run(main())

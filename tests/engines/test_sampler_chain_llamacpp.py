"""llama.cpp's sampler chain in the real worker, on the demo models: greedy text (the
chain's, and the in-place argmax of a greedy request with only biases) equal to the
numpy sampler's, seeded text that repeats, every chain freed, and one ``toks`` line
per step carrying every sequence's token."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from qrtest import demo_model_dir, realistic_repo
from quantroute.engines.base import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.llamacpp.worker import Worker, parse_args
from quantroute.engines.supervisor import RestartPolicy

pytestmark = pytest.mark.slow

PROMPT = "import os\n\ndef "
GREEDY_CASES: list[dict[str, object]] = [  # penalties or logprobs: the chain; else argmax
    {},
    {"ignore_eos": True, "max_tokens": 96},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"repetition_penalty": 0.9, "frequency_penalty": -0.5, "ignore_eos": True},
    {"logit_bias": ((100, 4.0), (101, -100.0), (100, 6.0))},  # a repeat: the last counts
    {"min_tokens": 24},
    {"logprobs": True, "top_logprobs": 3, "repetition_penalty": 1.2},
    {"top_k": 1, "temperature": 0.8, "seed": 3},  # top-k 1 is greedy whatever the rest
]


def _models() -> list[Path]:
    return [demo_model_dir() / "q8_0.gguf", realistic_repo() / "stdlib-bpe-llama" / "q8_0.gguf"]


async def _pair(model: Path) -> tuple[LlamaCppEngine, LlamaCppEngine]:
    pair = tuple(
        LlamaCppEngine(
            f"{model.parent.name}:{sampler}",
            model,
            WorkerOptions(parallel=2, n_threads=1, n_ctx=256, sampler=sampler),
            RestartPolicy(backoff_s=0.2),
        )
        for sampler in ("chain", "numpy")
    )
    for engine in pair:
        await engine.start()
        assert engine.ready
    return pair[0], pair[1]


@pytest.fixture(params=_models(), ids=lambda p: p.parent.name)
async def engines(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LlamaCppEngine, ...]]:
    pair = await _pair(request.param)
    yield pair
    for engine in pair:
        await engine.stop()


async def _run(engine: LlamaCppEngine, **sampling: object) -> tuple[list[TokenEvent], str, str]:
    params = {"max_tokens": 48, "temperature": 0.0} | sampling
    tokens, text, reason = [], [], ""
    request = GenerationRequest("t", PROMPT, SamplingParams(**params))  # type: ignore[arg-type]
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens.append(event)
            text.append(event.text)
        elif isinstance(event, FinishEvent):
            text.append(event.text)
            reason = event.reason.value
    return tokens, "".join(text), reason


async def test_the_chains_greedy_text_is_the_numpy_samplers(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    chain, numpy = engines
    for sampling in GREEDY_CASES:
        got, want = await _run(chain, **sampling), await _run(numpy, **sampling)
        assert got[1] == want[1] and got[2] == want[2], sampling
        assert [t.token_id for t in got[0]] == [t.token_id for t in want[0]], sampling
        assert [(t.logprob, t.top_logprobs) for t in got[0]] == [
            (t.logprob, t.top_logprobs) for t in want[0]
        ], sampling
    banned, _, _ = await _run(chain, min_tokens=24, max_tokens=24)
    assert len(banned) == 24  # end-of-generation was not sampled before min_tokens


async def test_seeded_sampling_with_every_knob_repeats_and_differs_by_seed(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    chain, _ = engines
    knobs = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "max_tokens": 64}
    knobs |= {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "ignore_eos": True}
    texts = [(await _run(chain, seed=seed, **knobs))[1] for seed in (11, 11, 12, -5, -5)]
    assert texts[0] == texts[1] and texts[3] == texts[4]
    assert texts[0] != texts[2] and texts[0] != texts[3]
    logprobs = await _run(chain, seed=11, logprobs=True, **knobs)  # the row is read, not drawn
    assert logprobs[1] == texts[0]


def _gen(rid: str, max_tokens: int, **sampling: Any) -> wire.Generate:
    knobs: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "seed": 1, "ignore_eos": True}
    params = SamplingParams(max_tokens=max_tokens, **(knobs | sampling))
    return wire.Generate(rid, PROMPT, params)


def test_every_sequences_chain_is_freed_however_it_ends() -> None:
    args = parse_args(["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "2"])
    args.n_threads, args.n_ctx = 1, 128
    worker = Worker(args, io.BytesIO())
    batcher = worker.batcher

    def steps(n: int) -> None:
        for _ in range(n):
            batcher.place_waiting()
            if batcher.active:
                batcher.step()
            worker.drop_refused()
            worker.flush()

    for cmd in (_gen("done", 3), _gen("active", 100), _gen("next", 100), _gen("queued", 100)):
        worker.handle(cmd)
    worker.handle(_gen("grammar", 8, grammar='root ::= "a"'))  # numpy's: no chain
    worker.handle(_gen("bad-bias", 8, logit_bias=((10**9, 1.0),)))  # refused before a chain
    worker.handle(_gen("too-long", 500))  # refused before a chain
    worker.handle(_gen("greedy", 4, temperature=0.0))  # argmax: no chain
    assert batcher.chains_open == 4
    steps(6)  # "done" finished and "next" took its slot; "queued" and "grammar" wait
    assert set(batcher.active) == {"active", "next"} and batcher.chains_open == 3
    worker.handle(wire.Cancel("queued"))  # waiting
    worker.handle(wire.Cancel("active"))  # decoding
    steps(1)
    assert batcher.chains_open == 1 and "next" in batcher.active
    worker.commands.put(None)  # shutdown with "next" and "grammar" still in flight
    worker.run()
    assert batcher.chains_open == 0


def test_one_line_per_step_carries_every_sequences_token() -> None:
    argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker", "--n-threads", "1"]
    argv += ["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "3"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert isinstance(wire.decode_event(proc.stdout.readline()), wire.Ready)
        gens = [_gen(f"r{i}", 6, temperature=0.0) for i in range(3)]
        gens.append(_gen("lp", 6, temperature=0.0, logprobs=True))  # waits for a slot
        proc.stdin.write(b"".join(wire.encode(g) for g in gens))
        proc.stdin.flush()
        lines: list[wire.Event] = []
        finished = 0
        while finished < 4:
            lines.append(wire.decode_event(proc.stdout.readline()))
            finished += isinstance(lines[-1], wire.Finished)
    finally:
        proc.stdin.close()
        proc.wait(60)
        proc.stdout.close()
    batches = [line.batch for line in lines if isinstance(line, wire.Tokens)]
    assert max(len(b) for b in batches) == 3  # three sequences' id, text, token in one line
    for rid in ("r0", "r1", "r2"):
        texts = [text for b in batches for r, text, _ in b if r == rid]
        fin = next(x for x in lines if isinstance(x, wire.Finished) and x.id == rid)
        assert len(texts) == fin.completion_tokens == 6
        last_token = max(
            i
            for i, x in enumerate(lines)
            if isinstance(x, wire.Tokens) and any(r == rid for r, _, _ in x.batch)
        )
        assert lines.index(fin) > last_token
    # a token with logprobs keeps its own "tok" event
    kinds = [type(x) for x in lines if getattr(x, "id", None) == "lp"]
    assert kinds == [wire.Started, *[wire.Token] * 6, wire.Finished]

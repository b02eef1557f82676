"""Prompt caching in the real llama.cpp worker: reuse, eviction, and outputs unchanged."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from qrtest import demo_model_dir, realistic_repo
from quantroute.engines.base import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.shaping.grammar import schema_grammar

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 6  # ~300 byte tokens


async def _engine(
    path: Path, *, cache: bool = True, parallel: int = 2, n_ctx: int = 0
) -> LlamaCppEngine:
    engine = LlamaCppEngine(
        "m:q8_0",
        path,
        WorkerOptions(parallel=parallel, n_threads=1, n_ctx=n_ctx, prompt_cache=cache),
        RestartPolicy(backoff_s=0.2, backoff_max_s=1.0),
    )
    await engine.start()
    assert engine.ready
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[tuple[LlamaCppEngine, LlamaCppEngine]]:
    """The same file twice: prompt cache on, and off (the reference outputs)."""
    path = demo_model_dir() / "q8_0.gguf"
    on, off = await asyncio.gather(_engine(path), _engine(path, cache=False))
    yield on, off
    await asyncio.gather(on.stop(), off.stop())


class Result:
    def __init__(self) -> None:
        self.start: StartEvent | None = None
        self.tokens: list[TokenEvent] = []
        self.finish: FinishEvent | None = None
        self.first_token_s = 0.0

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens) + (self.finish.text if self.finish else "")

    @property
    def reused(self) -> int:
        assert self.start is not None
        return self.start.cached_tokens


async def _run(engine: LlamaCppEngine, prompt: str, **sampling: object) -> Result:
    params = {"max_tokens": 16, "temperature": 0.0} | sampling
    request = GenerationRequest("t", prompt, SamplingParams(**params))  # type: ignore[arg-type]
    result, t0 = Result(), time.perf_counter()
    async for ev in engine.generate(request):
        if isinstance(ev, StartEvent):
            result.start = ev
        elif isinstance(ev, TokenEvent):
            if not result.tokens:
                result.first_token_s = time.perf_counter() - t0
            result.tokens.append(ev)
        else:
            result.finish = ev
    return result


async def test_a_shared_prefix_is_reused_and_the_output_is_unchanged(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    on, off = engines
    before = on.prompt_cache.cached_tokens
    first = await _run(on, PREFIX + "x = 1")
    again = await _run(on, PREFIX + "x = 1")  # the same prompt: all but its last token
    other = await _run(on, PREFIX + "y = 2")  # the shared prefix
    assert first.start is not None and again.start is not None
    assert again.reused == first.start.prompt_tokens - 1
    assert len(PREFIX) <= other.reused < len(PREFIX) + 5
    for prompt, cached in ((PREFIX + "x = 1", first), (PREFIX + "y = 2", other)):
        cold = await _run(off, prompt)
        assert cold.reused == 0
        assert cold.text == cached.text and cold.text
        assert [t.token_id for t in cold.tokens] == [t.token_id for t in cached.tokens]
    assert again.text == first.text
    stats = on.prompt_cache
    assert stats.cached_tokens - before == again.reused + other.reused + first.reused
    assert stats.hit_rate is not None and 0 < stats.hit_rate < 1
    assert off.prompt_cache.cached_tokens == 0 and off.prompt_cache.hit_rate == 0


async def test_a_conversation_reuses_its_own_output(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    on, off = engines
    turn = await _run(on, PREFIX + "# turn one\n", max_tokens=12)
    follow = PREFIX + "# turn one\n" + turn.text + "\n# turn two\n"
    nxt = await _run(on, follow)
    assert turn.start is not None
    # the prompt and (nearly) every generated token were kept; text that retokenizes
    # differently only shortens the shared prefix
    assert nxt.reused >= turn.start.prompt_tokens
    assert nxt.text == (await _run(off, follow)).text


async def test_sampled_logprobs_grammar_and_n_are_unchanged(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    on, off = engines
    await _run(on, PREFIX)  # something to reuse
    grammar = schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    # A seeded draw repeats only up to llama.cpp's batch-shape numerics (below): where two
    # candidates are within ~0.02 in log-probability their order can swap, and the same
    # draw then lands on the other one. Seed 7 meets such a near-tie at its 15th token with
    # llama.cpp's sampler chain (1 seed in 20 does, 0-19 tried); seed 8 does not.
    cases: list[dict[str, object]] = [
        {"temperature": 0.9, "top_p": 0.9, "seed": 8},
        {"logprobs": True, "top_logprobs": 3},
        {"grammar": grammar, "max_tokens": 24},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5},
    ]
    for sampling in cases:
        hot = await _run(on, PREFIX + "z", **sampling)
        assert hot.reused >= len(PREFIX), sampling
        cold = await _run(off, PREFIX + "z", **sampling)
        assert [t.token_id for t in hot.tokens] == [t.token_id for t in cold.tokens], sampling
        # equal up to llama.cpp's batch-shape numerics: a reused prefix prefills the rest
        # in a smaller batch, and q8_0's kernels then round differently (n_batch 16 vs 512
        # moves these logprobs by up to 0.02 with no cache at all)
        assert [t.logprob for t in hot.tokens] == pytest.approx(
            [t.logprob for t in cold.tokens], abs=0.05
        )
        assert [[x[0] for x in t.top_logprobs] for t in hot.tokens] == [
            [x[0] for x in t.top_logprobs] for t in cold.tokens
        ]
    # n > 1 at once: siblings run side by side, each in its own slot
    hot = await asyncio.gather(*(_run(on, PREFIX + "w", temperature=0.8, seed=s) for s in (1, 2)))
    cold = await asyncio.gather(*(_run(off, PREFIX + "w", temperature=0.8, seed=s) for s in (1, 2)))
    assert [r.text for r in hot] == [r.text for r in cold]
    assert max(r.reused for r in hot) >= len(PREFIX)


async def test_cancelled_and_stopped_sequences_leave_a_usable_cache(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    on, off = engines
    prompt = PREFIX + "# cancel me\n"
    stream = on.generate(GenerationRequest("c", prompt, SamplingParams(max_tokens=200)))
    async for ev in stream:
        if isinstance(ev, TokenEvent):
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0.2)
    stopped = await _run(on, prompt, stop=["\n"], max_tokens=40)
    assert stopped.reused >= len(PREFIX)
    cold = await _run(off, prompt, stop=["\n"], max_tokens=40)
    assert stopped.text == cold.text
    assert stopped.finish is not None and cold.finish is not None
    assert stopped.finish.reason == cold.finish.reason


async def test_scoring_neither_reuses_nor_leaves_cache(
    engines: tuple[LlamaCppEngine, LlamaCppEngine], tmp_path: Path
) -> None:
    on, off = engines
    prompt, tokens = PREFIX, [ord(c) for c in "    return"]
    ref = await off.write_logits(prompt, tokens, tmp_path / "ref.f32")
    for _ in range(3):  # with a cache of the same prompt in a slot: exact all the same
        await _run(on, PREFIX)
        scores = await on.score(prompt, tokens, ref)
        assert scores.kld.max() < 1e-6 and scores.top1.all()
    after = await _run(on, PREFIX + "q")
    assert after.reused >= len(PREFIX)  # the generation's cache survived the scoring


async def test_restart_empties_the_cache(
    engines: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    on, _ = engines
    await _run(on, PREFIX + "r")
    await on.restart()
    fresh = await _run(on, PREFIX + "r")
    assert fresh.reused <= 1  # the warm-up's BOS at most


async def test_lru_eviction_under_the_slots(tmp_path: Path) -> None:
    """Two slots, three prefixes: the least recently used cache is the one evicted, and
    a cached sequence never holds up a live one."""
    engine = await _engine(demo_model_dir() / "q8_0.gguf", parallel=2)
    try:
        a, b, c = ("# " + ch * 120 + "\n" for ch in "abc")
        await _run(engine, a)
        await _run(engine, b)
        assert (await _run(engine, a + "1")).reused >= 120  # a is kept; b older now
        await _run(engine, c)  # evicts b
        assert (await _run(engine, b + "1")).reused < 10  # BOS and "# " only
        assert (await _run(engine, c + "1")).reused >= 120
        # both slots hold caches; two live requests still run at once
        results = await asyncio.gather(*(_run(engine, f"# {i}\n") for i in range(2)))
        assert all(r.finish is not None for r in results)
    finally:
        await engine.stop()


# -- the goal: a shared 400-token prefix, first token at least 3x sooner --------------

ROUNDS = 5


async def test_a_shared_400_token_prefix_cuts_ttft_3x() -> None:
    """On the realistic model (32k BPE vocabulary, 8 layers): per round, a cold prompt
    (a prefix never seen) and a warm one (the same prefix, another question); medians
    of TTFT as the engine's caller sees it, over the real worker pipe."""
    path = realistic_repo() / "stdlib-bpe-llama" / "q8_0.gguf"
    on, off = await asyncio.gather(_engine(path, parallel=2), _engine(path, cache=False))
    words = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"
    try:
        cold_s, warm_s = [], []
        for i in range(ROUNDS):
            prefix = f"# module {i}\n" + words * 24
            cold = await _run(on, prefix + "\nclass Alpha:\n", max_tokens=8)
            warm = await _run(on, prefix + "\nclass Beta:\n", max_tokens=8)
            assert cold.start is not None and warm.start is not None
            assert cold.reused < 10 and warm.reused >= 400, (cold.reused, warm.reused)
            assert warm.start.prompt_tokens - warm.reused < 20
            reference = await _run(off, prefix + "\nclass Beta:\n", max_tokens=8)
            assert warm.text == reference.text and warm.tokens
            cold_s.append(cold.first_token_s)
            warm_s.append(warm.first_token_s)
        ratio = statistics.median(cold_s) / statistics.median(warm_s)
        print(
            f"TTFT cold {statistics.median(cold_s) * 1e3:.1f} ms, warm "
            f"{statistics.median(warm_s) * 1e3:.1f} ms: {ratio:.1f}x "
            f"(a prompt of {warm.start.prompt_tokens} tokens, {warm.reused} reused)"
        )
        assert ratio >= 3.0, (cold_s, warm_s)
    finally:
        await asyncio.gather(on.stop(), off.stop())

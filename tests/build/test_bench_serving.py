"""The serving benchmark's own rules: one token count for all, checked; a run whose greedy
text differs fails; the ceiling drives the real worker, and the bare gateway streams its text.
(The benchmark itself is not run.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving as bench  # noqa: E402
from serving_systems import (  # noqa: E402
    CEILING,
    LCP,
    LLAMA_SERVER,
    QUANTROUTE,
    Settings,
    Stream,
    WorkerCeiling,
    Workload,
    bare_gateway_system,
)

TINY = ROOT / "src" / "quantroute" / "demo" / "repo" / "tiny-llama" / "q8_0.gguf"


def stream(tokens: int, chunks: int, *, usage: bool = True, text: str = "ab", t0: float = 0.0,
           finish: str | None = "length") -> Stream:  # fmt: skip
    s = Stream(sent=t0, usage_tokens=tokens if usage else None, finish_reason=finish)
    s.arrivals = [t0 + 0.01 * (i + 1) for i in range(chunks)]
    s.text = [text] + [""] * (chunks - 1) if chunks else []
    return s


def test_tokens_are_usage_else_chunks_and_checked() -> None:
    assert stream(8, 3).tokens == 8  # coalesced chunks: usage counts
    assert stream(8, 8, usage=False).tokens == 8  # no usage streamed: the chunks
    assert stream(8, 3).count_error(8) is None
    assert "chunks" in (stream(3, 8).count_error(3) or "")  # more chunks than tokens
    assert "max_tokens" in (stream(7, 7).count_error(8) or "")  # stopped early: EOS got through
    assert stream(2, 2, finish=None).count_error(8) is None  # cut streams are counted as cut


def test_percentiles_and_gaps() -> None:
    assert bench._p99([float(i) for i in range(1, 101)]) == 99.0
    assert bench._p99([5.0]) == 5.0
    assert stream(3, 3).gaps_s == pytest.approx([0.01, 0.01])
    assert stream(3, 3, t0=1.0).ttft_s == pytest.approx(0.01)


def round_of(system: str, streams: list[Stream], wall: float = 1.0) -> bench.Round:
    return bench.Round("m", system, 1, 0, wall, 0.5, tuple(streams))


def test_a_differing_text_or_a_bad_count_fails_the_run() -> None:
    good = bench.Cell.of([round_of(QUANTROUTE, [stream(8, 8)])], 8, "ab")
    assert good.failures() == []
    other = bench.Cell.of([round_of(LLAMA_SERVER, [stream(8, 8, text="xy")])], 8, "ab")
    assert other.text_mismatches == 1 and other.failures()
    short = bench.Cell.of([round_of(QUANTROUTE, [stream(5, 5)])], 8, "ab")
    assert short.failures()
    cut = [stream(2, 2, finish=None), stream(8, 8)]  # llama-cpp-python cuts by design
    assert bench.Cell.of([round_of(LCP, cut)], 8, "ab").failures() == []
    assert bench.Cell.of([round_of(QUANTROUTE, cut)], 8, "ab").failures()


def test_a_gateways_own_cpu_per_token_is_over_every_round_or_none() -> None:
    def gateway_round(cpu_s: float | None) -> bench.Round:
        return bench.Round("m", QUANTROUTE, 1, 0, 1.0, 0.5, (stream(8, 8),), 0, cpu_s)

    cell = bench.Cell.of([gateway_round(0.0004), gateway_round(0.0012)], 8, "ab")
    assert cell.gateway_cpu_us_per_token == pytest.approx(100.0)  # 1.6 ms over 16 tokens
    assert cell.cpu_us_per_token == pytest.approx(62_500.0)  # the tree: 1 s over 16
    partial = bench.Cell.of([gateway_round(0.0004), gateway_round(None)], 8, "ab")
    assert partial.gateway_cpu_us_per_token is None  # a round without it: not a figure


def test_ratios_and_goals() -> None:
    def cell(system: str, n: int, wall: float, gateway_s: float | None) -> bench.Cell:
        rounds = [
            bench.Round("stdlib-bpe-llama", system, n, 0, wall, 0.1, (stream(8, 8),), 0, gateway_s)
        ]
        return bench.Cell.of(rounds, 8, "ab")

    systems = ((QUANTROUTE, 1.0, 0.0012), (LLAMA_SERVER, 0.5, None), (CEILING, 0.8, None))
    cells = {
        ("stdlib-bpe-llama", system, n): cell(system, n, wall, gateway_s)
        for system, wall, gateway_s in (*systems, (bench.BARE, 0.9, 0.001))
        for n in (1, 4)
    }
    r = bench.ratios(cells, "stdlib-bpe-llama", 4)
    assert r["decode"] == pytest.approx(0.5) and r["decode_vs_ceiling"] == pytest.approx(0.8)
    assert r["gateway_cpu_vs_bare"] == pytest.approx(1.2)
    goals = list(bench.goal_lines(cells, "stdlib-bpe-llama", [1, 4]))
    # 1 client: the gateway's CPU alone (1.2x: missed); 4: CPU, decode 0.5x, TTFT the same
    assert [met for _, met in goals] == [False, False, False, True]
    assert "1 client(s): gateway CPU" in goals[0][0] and "4 client(s): median TTFT" in goals[3][0]


def test_the_ceiling_drives_the_real_worker(tmp_path: Path) -> None:
    from quantroute.demo.vocab import EOS_ID

    async def run() -> Stream:
        ceiling = WorkerCeiling(TINY, Settings(1, 2, 256, False), tmp_path)
        ceiling.start(60.0)
        await ceiling.open()
        try:
            return await ceiling.stream(Workload("tiny-llama:q8_0", "def ", 8, EOS_ID, False))
        finally:
            await ceiling.close()

    got = asyncio.run(run())
    assert got.error is None and got.finish_reason == "length"
    assert got.tokens == 8 and 1 <= got.chunks <= 8 and got.count_error(8) is None
    assert "".join(got.text)


def test_the_bare_gateway_streams_the_ceilings_text(tmp_path: Path) -> None:
    from quantroute.demo.vocab import EOS_ID

    work = Workload("tiny-llama:q8_0", "def ", 8, EOS_ID, False)
    cfg = Settings(1, 2, 256, False)

    async def run() -> tuple[Stream, Stream]:
        ceiling = WorkerCeiling(TINY, cfg, tmp_path)
        ceiling.start(60.0)
        await ceiling.open()
        try:
            want = await ceiling.stream(work)
        finally:
            await ceiling.close()
        assert ceiling.gateway_cpu_s() is None  # no gateway in front of it
        bare = bare_gateway_system(TINY, cfg, tmp_path)
        await asyncio.to_thread(bare.start, 60.0)
        try:
            await bare.open()
            got = await bare.stream(work)
            await bare.close()
            gateway, tree = bare.gateway_cpu_s(), bare.cpu_s()
        finally:
            bare.stop()
        # its own process alone: less than the tree, which has its worker too
        assert gateway is not None and 0 < gateway < tree
        return want, got

    want, got = asyncio.run(run())
    assert got.error is None and got.finish_reason == "length"
    assert got.tokens == 8 and got.count_error(8) is None
    assert "".join(got.text) == "".join(want.text) != ""


class _Timed:
    """A system whose first token takes ``ttft_s``; it records the order it was asked in."""

    def __init__(self, name: str, ttft_s: float, calls: list[str]):
        self.name, self.retries, self.ttft_s, self.calls = name, 0, ttft_s, calls
        self.up = False

    def start(self, timeout_s: float) -> None:
        self.up = True

    def stop(self) -> None:
        self.up = False

    def cpu_s(self) -> float:
        return 0.0

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def stream(self, work: Workload) -> Stream:
        assert self.up
        self.calls.append(self.name)
        s = Stream(sent=0.0, usage_tokens=2, finish_reason="length")
        s.arrivals, s.text = [self.ttft_s, self.ttft_s + 0.01], ["ab", ""]
        return s


def test_the_paired_ttft_alternates_the_systems_request_by_request() -> None:
    calls: list[str] = []
    systems = [_Timed(QUANTROUTE, 0.012, calls), _Timed(LLAMA_SERVER, 0.010, calls)]
    work = Workload("m", "p", 8, 2, False)
    medians = asyncio.run(bench.paired_ttft(systems, work, 2, 3, 1.0))  # type: ignore[arg-type]
    warm = [QUANTROUTE, LLAMA_SERVER]
    first, second = [QUANTROUTE, LLAMA_SERVER] * 3, [LLAMA_SERVER, QUANTROUTE] * 3
    assert calls == warm + first + second  # who goes first rotates round by round
    assert not any(s.up for s in systems)  # every system stopped
    assert medians[QUANTROUTE] == pytest.approx([0.012, 0.012])
    assert bench.paired_ratio(medians, QUANTROUTE, LLAMA_SERVER) == pytest.approx(1.2)
    assert bench.paired_ratio(medians, "bare-gateway", LLAMA_SERVER) is None

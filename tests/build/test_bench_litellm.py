"""The gateway-cost benchmark's pure parts: percentiles, added latency and its medians over
rounds, the p99 ratio and the goal, CPU per token, the run's failures and the configs it
writes for LiteLLM and quantroute. (No server is started.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "bench_gateway_cost", ROOT / "benchmarks" / "bench_litellm.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

from quantroute.registry.manifest import parse_manifest  # noqa: E402


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([7.0], 99, 7.0),
        ([3.0, 1.0, 2.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),  # nearest rank: ceil(0.5 * 4) = 2nd
        (list(range(1, 101)), 99, 99),
        (list(range(1, 201)), 99, 198),
        (list(range(1, 11)), 99, 10),
        (list(range(1, 11)), 100, 10),
    ],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert bench.percentile(values, q) == expected


def test_added_is_the_difference_of_percentiles_not_of_pairs() -> None:
    direct = [1.0, 2.0, 3.0, 4.0, 100.0]
    gateway = [2.0, 3.0, 4.0, 5.0, 6.0]
    assert bench.added(gateway, direct, 50) == 1.0
    assert bench.added(gateway, direct, 99) == -94.0  # a gateway can look faster at a tail
    assert bench.added([], direct, 50) is None


def sample(prompt: int, ttft: float, e2e: float, tokens: int = 8, **kw: object) -> object:
    return bench.Sample(prompt, ttft_s=ttft, e2e_s=e2e, tokens=tokens, **kw)


def turn(target: str, clients: int, index: int, ttfts: list[float], *, extra_s: float = 0.0,
         cpu_s: float | None = None, tokens: int = 8) -> object:  # fmt: skip
    samples = [sample(i % 2, t, t + 0.05 + extra_s, tokens) for i, t in enumerate(ttfts)]
    return bench.Turn(target, clients, index, 1.0, cpu_s, 0.5, 0, samples)


def test_summary_takes_the_median_over_rounds_of_each_rounds_added_latency() -> None:
    d, q, li = bench.DIRECT, bench.QUANTROUTE, bench.LITELLM
    turns = []
    for index, (q_add, l_add) in enumerate([(0.001, 0.010), (0.002, 0.030), (0.009, 0.020)]):
        base = [0.010 + 0.001 * i for i in range(10)]
        turns += [
            turn(d, 4, index, base),
            turn(q, 4, index, [b + q_add for b in base], cpu_s=0.008),
            turn(li, 4, index, [b + l_add for b in base], extra_s=l_add, cpu_s=0.08),
        ]
    level = bench.summarize(turns, [4], [q, li])[4]
    assert level[q]["added_per_round_ms"]["ttft_p99"] == pytest.approx([1.0, 2.0, 9.0])
    assert level[q]["added_ttft_p99_ms"] == pytest.approx(2.0)  # median of 1, 2, 9
    assert level[li]["added_ttft_p50_ms"] == pytest.approx(20.0)
    assert level[li]["added_e2e_p99_ms"] == pytest.approx(40.0)  # ttft + e2e's own extra
    assert level[q]["added_e2e_p99_ms"] == pytest.approx(2.0)
    assert level["ratio_ttft_p99"] == pytest.approx(0.1)
    assert level["goal_ttft_p99"] is True
    assert level["ratio_e2e_p99"] == pytest.approx(0.05)
    # CPU per token: all rounds' CPU over all rounds' tokens (3 x 0.008 s / (3 x 10 x 8))
    assert level[q]["cpu_us_per_token"] == pytest.approx(100.0)
    assert level[li]["cpu_us_per_token"] == pytest.approx(1000.0)
    assert level[d]["ttft_p50_ms"] == pytest.approx(14.0)


def test_a_round_without_its_direct_turn_adds_nothing() -> None:
    turns = [turn(bench.QUANTROUTE, 1, 0, [0.01]), turn(bench.DIRECT, 1, 1, [0.01])]
    assert bench.added_per_round(turns, bench.QUANTROUTE, 1)["ttft_p50"] == []


@pytest.mark.parametrize(
    ("quantroute", "litellm", "ratio", "met"),
    [
        (1.0, 3.0, 1 / 3, True),
        (1.0, 2.0, 0.5, False),
        (-0.2, 5.0, -0.04, True),  # quantroute faster than direct: met
        (1.0, 0.0, None, None),  # LiteLLM added nothing: no ratio to speak of
        (1.0, -1.0, None, None),
        (None, 3.0, None, None),
    ],
)
def test_ratio_and_goal(
    quantroute: float | None, litellm: float | None, ratio: float | None, met: bool | None
) -> None:
    got = bench.ratio(quantroute, litellm)
    assert got == (None if ratio is None else pytest.approx(ratio))
    assert bench.goal_met(got) is met


def test_cpu_per_token_is_none_for_direct_or_no_tokens() -> None:
    assert bench.cpu_us_per_token([turn(bench.DIRECT, 1, 0, [0.01])], bench.DIRECT, 1) is None
    t = turn(bench.QUANTROUTE, 1, 0, [0.01], cpu_s=1.0, tokens=0)
    assert bench.cpu_us_per_token([t], bench.QUANTROUTE, 1) is None


def test_failures_name_errors_counts_and_texts_unlike_direct() -> None:
    d = bench.Turn(bench.DIRECT, 1, 0, 1.0, None, 0.5, 0, [
        sample(0, 0.01, 0.02, text="abc"), sample(1, 0.01, 0.02, text="xyz"),
    ])  # fmt: skip
    ok = bench.Turn(bench.LITELLM, 1, 0, 1.0, 0.1, 0.5, 0, [
        sample(0, 0.01, 0.02, text="abc"), sample(1, 0.01, 0.02),
    ])  # fmt: skip
    bad = bench.Turn(bench.QUANTROUTE, 16, 0, 1.0, 0.1, 0.5, 0, [
        sample(0, 0.01, 0.02, text="abd"), sample(1, 0.01, 0.02, tokens=7),
        bench.Sample(1, error="HTTP 503: b'busy'"),
    ])  # fmt: skip
    assert bench.failures([d, ok], 8) == []
    got = bench.failures([d, ok, bad], 8)
    assert len(got) == 3
    assert all(f.startswith("quantroute, 16 client(s), round 1") for f in got)
    assert "1 failed request(s), e.g. HTTP 503" in got[0]
    assert "not of 8 tokens: [7]" in got[1]
    assert "1 text(s) unlike llama-server's own" in got[2]


def test_litellm_config_is_one_openai_model_at_the_server_logging_off() -> None:
    config = yaml.safe_load(bench.litellm_config("tiny-llama", "http://127.0.0.1:8081/v1"))
    assert config["model_list"] == [{
        "model_name": "tiny-llama",
        "litellm_params": {
            "model": "openai/tiny-llama", "api_base": "http://127.0.0.1:8081/v1",
            "api_key": "none",
        },
    }]  # fmt: skip
    assert config["litellm_settings"]["set_verbose"] is False
    assert config["general_settings"]["disable_spend_logs"] is True


def test_quantroute_manifest_is_one_remote_branch_the_manifest_accepts() -> None:
    url = "http://127.0.0.1:8081/v1"
    text = bench.quantroute_manifest("tiny-llama", url, "tiny-llama", "q8_0", 128)
    raw = yaml.safe_load(text)
    assert raw["branches"]["remote"]["remote"] == {"server": "llama-server", "max_connections": 128}
    assert raw["branches"]["remote"]["engine"] == "openai"
    assert raw["branches"]["remote"]["url"] == "http://127.0.0.1:8081/v1"
    assert raw["branches"]["remote"]["remote_model"] == "tiny-llama"
    manifest = parse_manifest(Path("tiny-llama"), text.encode())
    assert list(manifest.branches) == ["remote"]
    assert manifest.branches["remote"].url == "http://127.0.0.1:8081/v1"


def test_chat_body_is_greedy_streamed_with_usage_and_eos_banned() -> None:
    body = json.loads(bench.chat_body("m", "def f():", 16, 2))
    assert body["messages"] == [{"role": "user", "content": "def f():"}]
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (16, 0.0, True)
    assert body["stream_options"] == {"include_usage": True}
    assert body["logit_bias"] == {"2": -100.0}


def test_markdown_and_goal_lines_show_every_level() -> None:
    d, q, li = bench.DIRECT, bench.QUANTROUTE, bench.LITELLM
    base = [0.01, 0.02]
    turns = [turn(d, 1, 0, base), turn(q, 1, 0, [b + 0.001 for b in base], cpu_s=0.01),
             turn(li, 1, 0, [b + 0.01 for b in base], cpu_s=0.1)]  # fmt: skip
    summary = bench.summarize(turns, [1], [q, li])
    table = bench.markdown(summary, [q, li])
    assert "| 1 | quantroute | 1.00 / 1.00 | 1.00 / 1.00 | 625 | 0 of 2 |" in table
    assert "| 1 | LiteLLM proxy | 10.00 / 10.00 |" in table
    assert bench.goal_lines(summary)[0].endswith("= 0.10 (goal <= 0.33): met")

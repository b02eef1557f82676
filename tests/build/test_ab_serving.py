"""The A/B serving benchmark's arithmetic: each system's rate against the reference's in the
same round, CPU per token of the gateway and of its workers apart. (Not run here.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_serving as ab  # noqa: E402


def burst(system: str, round_: int, tokens: int, gateway_s: float = 0.0) -> ab.Burst:
    return ab.Burst("m", system, 4, round_, tokens, 1.0, gateway_s, 2 * gateway_s, 3 * gateway_s)


def test_ratios_pair_rounds_and_cpu_is_over_all_tokens() -> None:
    bursts = [
        burst("after", 0, 900, 0.09), burst("after", 1, 500, 0.05),
        burst("ref", 0, 1000), burst("ref", 1, 400),  # the machine slowed in round 1
    ]  # fmt: skip
    got = ab.cells(bursts, ["after", "ref"], "ref")
    after = got[(4, "after")]
    # 0.9 and 1.25 by round: the slow round counts against both, not against "after"
    assert (after.ratio_min, after.ratio_max) == pytest.approx((0.9, 1.25))
    assert after.ratio == pytest.approx((0.9 + 1.25) / 2)
    assert after.tok_s == pytest.approx(700.0)
    assert after.gateway_us == pytest.approx(100.0) and after.workers_us == pytest.approx(200.0)
    assert after.client_us == pytest.approx(300.0)
    assert got[(4, "ref")].ratio == 1.0


def test_a_tree_must_hold_the_package() -> None:
    with pytest.raises(SystemExit):
        ab.parse_args(["--tree", "before=/nonexistent"])
    args = ab.parse_args(["--tree", f"after={ROOT / 'src'}"])
    assert args.tree == [("after", ROOT / "src")]

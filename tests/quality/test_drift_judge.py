"""The drift monitor's pure parts: windows, the verdict, and the hot-path sampling."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from quantroute.config import DriftSettings
from quantroute.engines.base import EngineInfo
from quantroute.quality.drift import (
    DriftMonitor,
    DriftState,
    DriftWindow,
    Replay,
    WindowResult,
    judge,
)

SETTINGS = DriftSettings(windows_to_flag=2, windows_to_recover=3, fraction=1.0, queue=2)


def _window(ok: bool) -> WindowResult:
    return WindowResult(0.0 if ok else 1.0, 1.0, 10, ok)


@pytest.mark.parametrize(
    ("verdicts", "degraded_after_each"),
    [
        ("g", [False]),
        ("b", [False]),
        ("bb", [False, True]),
        ("bgb", [False, False, False]),  # not consecutive
        ("bbg", [False, True, True]),
        ("bbggg", [False, True, True, True, False]),  # recovers after 3 good windows
        ("bbggbggg", [False, True, True, True, True, True, True, False]),
    ],
)
def test_judge_flags_and_recovers_on_consecutive_windows(
    verdicts: str, degraded_after_each: list[bool]
) -> None:
    state = DriftState()
    seen = []
    for v in verdicts:
        state = judge(state, _window(v == "g"), SETTINGS)
        seen.append(state.degraded)
    assert seen == degraded_after_each
    assert state.windows == len(verdicts)


def test_window_closes_every_size_tokens_and_keeps_the_rest() -> None:
    w = DriftWindow(4)
    assert w.add(np.array([0.1, 0.3]), np.array([True, False])) == []
    closed = w.add(np.array([0.2, 0.2, 1.0, 1.0, 1.0, 1.0, 9.0]), np.ones(7, dtype=bool))
    assert [(round(k, 6), t, n) for k, t, n in closed] == [(0.2, 0.75, 4), (1.0, 1.0, 4)]


@dataclass
class _Scorer:
    """Stands in for an engine in the hot-path sampling test only."""

    busy: int = 0

    @property
    def ready(self) -> bool:
        return True

    @property
    def in_flight(self) -> int:
        return self.busy

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(512, 512, 8, 4, None, "<s>", "</s>", 0)

    async def score(
        self, prompt: str, tokens: list[int], *, parse_special: bool = False
    ) -> npt.NDArray[np.float32]:
        raise AssertionError("not replayed in this test")


async def test_offer_samples_skips_the_reference_and_respects_capacity() -> None:
    ref, branch = _Scorer(), _Scorer()
    monitor = DriftMonitor(
        SETTINGS,
        reference={"m:f16": "m:f16", "m:q4": "m:f16"},
        scorers={"m:f16": ref, "m:q4": branch},
        baselines={},
        rng=random.Random(0),
    )
    replay = Replay("m:q4", "x", (1, 2, 3), False)
    assert not monitor.offer(Replay("m:f16", "x", (1,), False))  # the reference vs itself
    assert not monitor.offer(Replay("m:q4", "x", (), False))  # nothing generated
    ref.busy = 2  # half of the reference's 4 sequences busy: no spare capacity
    assert not monitor.offer(replay)
    ref.busy = 0
    assert monitor.offer(replay) and monitor.offer(replay)
    assert not monitor.offer(replay)  # the queue (2) is full: dropped, never waited on
    assert monitor.state("m:q4").dropped == 2
    sampled = DriftMonitor(
        DriftSettings(fraction=0.25, queue=1000),
        reference={"m:q4": "m:f16"},
        scorers={"m:f16": ref, "m:q4": branch},
        baselines={},
        rng=random.Random(1),
    )
    taken = sum(sampled.offer(replay) for _ in range(800))
    assert 150 < taken < 250

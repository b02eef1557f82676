"""The drift monitor's pure parts: windows, the verdict, the hot-path sampling, and the
plumbing of one replay (a logits file made, compared and always deleted)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from quantroute.config import DriftSettings
from quantroute.engines.base import EngineInfo, ReferenceLogits, TokenScores
from quantroute.errors import EngineCrashedError
from quantroute.quality.drift import (
    DriftMonitor,
    DriftState,
    DriftWindow,
    LogitsFiles,
    Replay,
    WindowResult,
    judge,
)
from quantroute.quality.metrics import kl_divergence, log_softmax, top1_agreement

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


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@dataclass
class _Scorer:
    """Stands in for an engine: its "model" is a fixed ``[T, V]`` table of logits.
    Like a worker, it writes a reference's rows to the file and compares a branch's
    rows with one, so only ``[T]`` results reach the monitor."""

    busy: int = 0
    logits: np.ndarray | None = None  # [T, V]
    fail: bool = False
    files_seen: list[Path] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return True

    @property
    def can_score(self) -> bool:
        return True

    @property
    def in_flight(self) -> int:
        return self.busy

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(512, 512, 8, 4, None, "<s>", "</s>", 0)

    async def write_logits(
        self, prompt: str, tokens: list[int], path: Path, *, parse_special: bool = False
    ) -> ReferenceLogits:
        assert self.logits is not None, "not replayed in this test"
        rows = self.logits[: len(tokens)].astype(np.float32)
        _write_new(path, rows.tobytes())
        self.files_seen.append(path)
        return ReferenceLogits(path, *rows.shape)

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        assert self.logits is not None, "not replayed in this test"
        assert reference.path.exists()
        if self.fail:
            raise EngineCrashedError("the worker died (injected)")
        ref = np.fromfile(reference.path, dtype=np.float32).reshape(
            reference.n_tokens, reference.n_vocab
        )
        p, q = log_softmax(ref), log_softmax(self.logits[: len(tokens)])
        return TokenScores(kl_divergence(p, q), top1_agreement(p, q))


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


def _pair(tmp_path: Path, noise: float) -> tuple[DriftMonitor, _Scorer, _Scorer]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((64, 8)) * 3
    ref = _Scorer(logits=base)
    branch = _Scorer(logits=base + noise * rng.standard_normal(base.shape))
    monitor = DriftMonitor(
        DriftSettings(window_tokens=16, windows_to_flag=2, fraction=1.0),
        reference={"m:f16": "m:f16", "m:q4": "m:f16"},
        scorers={"m:f16": ref, "m:q4": branch},
        baselines={},
        files=LogitsFiles([tmp_path]),
    )
    return monitor, ref, branch


@pytest.mark.parametrize(("noise", "degraded"), [(0.0, False), (2.0, True)])
async def test_replay_judges_from_the_branch_side_scores_and_deletes_the_file(
    tmp_path: Path, noise: float, degraded: bool
) -> None:
    monitor, ref, _ = _pair(tmp_path, noise)
    for _ in range(3):
        await monitor.replay(Replay("m:q4", "x", tuple(range(16)), False))
    state = monitor.state("m:q4")
    assert state.replays == 3 and state.windows == 3
    assert state.degraded is degraded
    assert state.last is not None and (state.last.mean_kld > 0.05) is degraded
    assert len(set(ref.files_seen)) == 3  # a fresh file each time...
    assert _names(tmp_path) == []  # ...and none left


async def test_a_failed_replay_counts_nothing_and_still_deletes_its_file(tmp_path: Path) -> None:
    monitor, ref, branch = _pair(tmp_path, 2.0)
    branch.fail = True
    with pytest.raises(EngineCrashedError):
        await monitor.replay(Replay("m:q4", "x", tuple(range(16)), False))
    assert ref.files_seen and _names(tmp_path) == []
    assert monitor.state("m:q4").replays == 0


def test_logits_files_are_named_for_their_gateway_and_swept_when_it_is_gone(
    tmp_path: Path,
) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    files = LogitsFiles([tmp_path])
    mine = files.new(1000)
    assert mine.parent == tmp_path and mine.name.startswith(f"quantroute-logits.{os.getpid()}.")
    assert files.new(1000) != mine
    orphan = LogitsFiles([tmp_path], pid=dead_pid).new(1000)
    old = files.new(1000)
    live_other = LogitsFiles([tmp_path], pid=os.getppid()).new(1000)
    unrelated = tmp_path / "notes.txt"
    for path in (mine, orphan, old, live_other, unrelated):
        path.write_bytes(b"x")
    an_hour_ago = time.time() - 3700
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert files.sweep() == 2
    assert _names(tmp_path) == sorted(p.name for p in (mine, live_other, unrelated))


def test_logits_files_prefer_the_first_directory_with_room(tmp_path: Path) -> None:
    small, big = tmp_path / "a", tmp_path / "b"
    small.mkdir(), big.mkdir()
    files = LogitsFiles([small, big])
    assert files.new(1000).parent == small
    assert files.new(1 << 62).parent == big  # room nowhere: the last one (the worker errs)
    with pytest.raises(ValueError):
        LogitsFiles([tmp_path / "missing"])


async def test_the_monitor_sweeps_orphans_when_it_starts(tmp_path: Path) -> None:
    orphan = LogitsFiles([tmp_path], pid=2**22 + 12345).new(10)  # above pid_max: never alive
    orphan.write_bytes(b"x")
    monitor, _, _ = _pair(tmp_path, 0.0)
    monitor.start()
    for _ in range(100):
        if not orphan.exists():
            break
        await asyncio.sleep(0.01)
    await monitor.stop()
    assert not orphan.exists()

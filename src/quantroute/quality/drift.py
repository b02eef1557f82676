"""The drift monitor: is each branch still as faithful as its profile says?

A small share of finished requests (``drift.fraction``, only while the
reference branch has spare capacity) is replayed off the hot path: the tokens
the branch served are teacher-forced through the branch *and* through its
model's reference, and each token's KL divergence and top-1 agreement go into
the branch's current window of ``drift.window_tokens`` tokens. A closed window
is out of bounds when

    mean KLD > profiled mean KLD + δ      or      top-1 < profiled top-1 - Δ

(without a valid profile, against 0 and 1). ``windows_to_flag`` such windows
in a row mark the branch *degraded* (an alert is logged); ``windows_to_recover``
good windows in a row clear it. Readers take ``monitor.state(branch_id)``, an
immutable record swapped by reference, without locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from quantroute.config import DriftSettings
from quantroute.engines.base import EngineInfo
from quantroute.quality.metrics import kl_divergence, top1_agreement

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the monitor needs of an engine: teacher-forced log-softmax rows."""

    @property
    def ready(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def info(self) -> EngineInfo | None: ...

    async def score(
        self, prompt: str, tokens: list[int], *, parse_special: bool = False
    ) -> npt.NDArray[np.float32]: ...


@dataclass(frozen=True, slots=True)
class Baseline:
    """What the branch should look like: its profile, or perfection when unprofiled."""

    mean_kld: float = 0.0
    top1: float = 1.0


@dataclass(frozen=True, slots=True)
class WindowResult:
    mean_kld: float
    top1: float
    n_tokens: int
    in_bounds: bool


@dataclass(frozen=True, slots=True)
class DriftState:
    """A branch's drift state; replaced whole on every closed window."""

    degraded: bool = False
    windows: int = 0
    out_of_bounds_in_a_row: int = 0
    in_bounds_in_a_row: int = 0
    last: WindowResult | None = None
    replays: int = 0
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class Replay:
    branch: str
    prompt: str
    tokens: tuple[int, ...]
    parse_special: bool


class DriftWindow:
    """Per-token KLD and top-1 of one branch until a window is full. Pure."""

    def __init__(self, size: int):
        self.size = size
        self._kld: list[float] = []
        self._top1: list[bool] = []

    def add(
        self, kld: npt.NDArray[np.float64], top1: npt.NDArray[np.bool_]
    ) -> list[tuple[float, float, int]]:
        """Add per-token values; return ``(mean KLD, top-1, tokens)`` of every window closed."""
        self._kld.extend(kld.tolist())
        self._top1.extend(top1.tolist())
        closed = []
        while len(self._kld) >= self.size:
            k, t = self._kld[: self.size], self._top1[: self.size]
            del self._kld[: self.size], self._top1[: self.size]
            closed.append((float(np.mean(k)), float(np.mean(t)), self.size))
        return closed


def judge(state: DriftState, window: WindowResult, settings: DriftSettings) -> DriftState:
    """The next state after one closed window. Pure, table-tested."""
    if window.in_bounds:
        good, bad = state.in_bounds_in_a_row + 1, 0
    else:
        good, bad = 0, state.out_of_bounds_in_a_row + 1
    degraded = state.degraded
    if not degraded and bad >= settings.windows_to_flag:
        degraded = True
    elif degraded and good >= settings.windows_to_recover:
        degraded = False
    return replace(
        state,
        degraded=degraded,
        windows=state.windows + 1,
        out_of_bounds_in_a_row=bad,
        in_bounds_in_a_row=good,
        last=window,
    )


class DriftMonitor:
    """Owns one background task that replays sampled requests; see the module docstring."""

    def __init__(
        self,
        settings: DriftSettings,
        *,
        reference: Mapping[str, str],  # branch id -> its model's reference branch id
        scorers: Mapping[str, Scorer],  # branch id -> engine
        baselines: Mapping[str, Baseline],
        on_change: Callable[[str, DriftState], None] | None = None,
        rng: random.Random | None = None,
    ):
        self.settings = settings
        self._reference = dict(reference)
        self._scorers = dict(scorers)
        self._baselines = dict(baselines)
        self._on_change = on_change
        self._rng = rng or random.Random()
        self._states: dict[str, DriftState] = {b: DriftState() for b in self._reference}
        self._windows = {b: DriftWindow(settings.window_tokens) for b in self._reference}
        self._queue: asyncio.Queue[Replay] = asyncio.Queue(maxsize=settings.queue)
        self._task: asyncio.Task[None] | None = None

    def state(self, branch: str) -> DriftState:
        return self._states.get(branch, DriftState())

    def degraded(self, branch: str) -> bool:
        return self.state(branch).degraded

    # -- the hot path: one cheap decision, never a wait -------------------------

    def offer(self, replay: Replay) -> bool:
        """Called when a request finishes; queues it for replay when sampled and there is room."""
        ref = self._reference.get(replay.branch)
        if ref is None or ref == replay.branch or not replay.tokens:
            return False
        if self._rng.random() >= self.settings.fraction:
            return False
        scorer = self._scorers.get(ref)
        if scorer is None or not scorer.ready or scorer.info is None:
            return self._drop(replay.branch)
        if scorer.in_flight >= max(1, scorer.info.parallel // 2):
            return self._drop(replay.branch)  # the reference has no spare capacity
        tokens = replay.tokens[: self.settings.max_tokens]
        try:
            self._queue.put_nowait(replace(replay, tokens=tokens))
        except asyncio.QueueFull:
            return self._drop(replay.branch)
        return True

    def _drop(self, branch: str) -> bool:
        state = self.state(branch)
        self._states[branch] = replace(state, dropped=state.dropped + 1)
        return False

    # -- off the hot path ------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="drift-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            replay = await self._queue.get()
            try:
                await self.replay(replay)
            except Exception as exc:  # a failed replay says nothing about quality: skip it
                log.warning("drift: replay on %s failed: %s", replay.branch, exc)

    async def replay(self, replay: Replay) -> None:
        ref_scorer = self._scorers[self._reference[replay.branch]]
        scorer = self._scorers[replay.branch]
        tokens = list(replay.tokens)
        ref_rows, rows = await asyncio.gather(
            ref_scorer.score(replay.prompt, tokens, parse_special=replay.parse_special),
            scorer.score(replay.prompt, tokens, parse_special=replay.parse_special),
        )
        kld = kl_divergence(ref_rows, rows)  # [T]
        same = top1_agreement(ref_rows, rows)  # [T]
        state = self.state(replay.branch)
        self._states[replay.branch] = state = replace(state, replays=state.replays + 1)
        for mean_kld, top1, n in self._windows[replay.branch].add(kld, same):
            self._close(replay.branch, mean_kld, top1, n)

    def _close(self, branch: str, mean_kld: float, top1: float, n: int) -> None:
        base = self._baselines.get(branch, Baseline())
        s = self.settings
        in_bounds = mean_kld <= base.mean_kld + s.kld_delta and top1 >= base.top1 - s.top1_delta
        before = self.state(branch)
        after = judge(before, WindowResult(mean_kld, top1, n, in_bounds), s)
        self._states[branch] = after
        if after.degraded != before.degraded:
            if after.degraded:
                log.error(
                    "ALERT drift: %s degraded: window mean KLD %.4f (profile %.4f), top-1 %.3f "
                    "(profile %.3f) for %d windows",
                    branch,
                    mean_kld,
                    base.mean_kld,
                    top1,
                    base.top1,
                    after.out_of_bounds_in_a_row,
                )
            else:
                log.warning("drift: %s back within bounds", branch)
            if self._on_change is not None:
                self._on_change(branch, after)

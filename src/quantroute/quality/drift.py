"""The drift monitor: is each branch still as faithful as its profile says?

A small share of finished requests (``drift.fraction``, only while the
reference branch has spare capacity) is replayed off the hot path: the tokens
the branch served are teacher-forced through the model's reference, whose
worker writes the logits to a file (:class:`LogitsFiles`: shared memory,
deleted after use), and then through the branch, whose worker compares its
rows with that file. Only each token's KL divergence and top-1 agreement come
back to the gateway — no vocabulary-sized array ever crosses a pipe or the
event loop — and go into the branch's current window of
``drift.window_tokens`` tokens. A closed window is out of bounds when

    mean KLD > profiled mean KLD + δ      or      top-1 < profiled top-1 - Δ

(without a valid profile, against 0 and 1). ``windows_to_flag`` such windows
in a row mark the branch *degraded* (an alert is logged); ``windows_to_recover``
good windows in a row clear it. Readers take ``monitor.state(branch_id)``, an
immutable record swapped by reference, without locks.

A **remote branch** (``engine: openai``) is sampled the same way. Its answer comes as
text, so the reference's worker tokenizes it (the first ``max_tokens`` tokens) while
it writes the logits, and says which ids it took; the branch's server is then asked
for its top logprobs along those same ids and the comparison happens in the gateway,
in a thread (``OpenAIEngine.score``): the KLD is then the top-k estimate, a lower
bound, as its profile's is (``docs/quality.md``). A model whose reference is remote
has no drift replay: no server gives whole logit rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from quantroute.config import DriftSettings
from quantroute.engines.base import EngineInfo, ReferenceLogits, TokenScores
from quantroute.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the monitor needs of an engine: the reference writes teacher-forced logits
    to a file; a branch compares its own with them, where both distributions are."""

    @property
    def ready(self) -> bool: ...

    @property
    def can_score(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def info(self) -> EngineInfo | None: ...

    async def write_logits(
        self,
        prompt: str,
        tokens: list[int],
        path: Path,
        *,
        parse_special: bool = False,
        text: str | None = None,
        limit: int = 0,
    ) -> ReferenceLogits: ...

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores: ...


class LogitsFiles:
    """Names the files a reference's logits go to, and cleans up after gateways that died.

    A file is ``quantroute-logits.<gateway pid>.<random hex>.f32``, in ``/dev/shm``
    when it has room (shared memory: written and read without touching a disk),
    else in the temporary directory. The monitor deletes each after its replay;
    :meth:`sweep` deletes those of gateways no longer running and any older than
    ``stale_after_s`` (one a cancelled replay's worker finished writing anyway).
    """

    PREFIX = "quantroute-logits."

    def __init__(
        self,
        dirs: Sequence[Path] | None = None,
        *,
        stale_after_s: float = 3600.0,
        pid: int | None = None,
    ):
        if dirs is None:
            dirs = [Path("/dev/shm"), Path(tempfile.gettempdir())]
        self.dirs = [d for d in dirs if d.is_dir() and os.access(d, os.W_OK | os.X_OK)]
        if not self.dirs:
            raise ValueError(f"no writable directory for logits among {[str(d) for d in dirs]}")
        self.stale_after_s = stale_after_s
        self._pid = os.getpid() if pid is None else pid

    def new(self, nbytes: int) -> Path:
        """A fresh path (no file yet: the worker creates it) where ``nbytes`` should fit."""
        directory = self.dirs[-1]
        for d in self.dirs:
            with contextlib.suppress(OSError):
                if shutil.disk_usage(d).free >= 2 * nbytes:
                    directory = d
                    break
        return directory / f"{self.PREFIX}{self._pid}.{uuid.uuid4().hex}.f32"

    def sweep(self) -> int:
        """Delete files of gateways that are gone, and stale ones; return how many."""
        now = time.time()
        removed = 0
        for d in self.dirs:
            try:
                names = [n for n in os.listdir(d) if n.startswith(self.PREFIX)]
            except OSError:
                continue
            for name in names:
                path = d / name
                try:
                    owner = int(name[len(self.PREFIX) :].split(".", 1)[0])
                    stale = now - path.lstat().st_mtime > self.stale_after_s
                except (ValueError, OSError):
                    continue
                if stale or (owner != self._pid and not _alive(owner)):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed += 1
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


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


# The characters of a remote answer kept per token replayed: more than any token's text,
# so that the reference tokenizes no more than a replay uses.
CHARS_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class Replay:
    """A finished request to replay: its branch, prompt and answer. ``tokens`` are the
    answer's ids (``-1`` where the engine did not say: a remote branch); when any is
    unknown, ``text`` is the answer and the reference tokenizes it."""

    branch: str
    prompt: str
    tokens: tuple[int, ...]
    parse_special: bool
    text: str = ""

    @property
    def by_text(self) -> bool:
        return any(t < 0 for t in self.tokens)


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
        files: LogitsFiles | None = None,
    ):
        self.settings = settings
        self._files = files
        self._reference = dict(reference)
        self._scorers = dict(scorers)
        self._baselines = dict(baselines)
        self._on_change = on_change
        self._rng = rng or random.Random()
        self._states: dict[str, DriftState] = {b: DriftState() for b in self._reference}
        self.version = 0  # counts changes of any branch's verdict (routing rereads on one)
        self._windows = {b: DriftWindow(settings.window_tokens) for b in self._reference}
        self._queue: asyncio.Queue[Replay] = asyncio.Queue(maxsize=settings.queue)
        self._task: asyncio.Task[None] | None = None

    def state(self, branch: str) -> DriftState:
        return self._states.get(branch, DriftState())

    def adopt(self, old: DriftMonitor, branches: Iterable[str]) -> None:
        """Carry ``old``'s verdicts and open windows over for ``branches`` (the same worker
        and the same baseline in both): a reload does not forget that a branch drifted."""
        for b in branches:
            if (
                b in self._states
                and b in old._states
                and self._baselines.get(b) == old._baselines.get(b)
            ):
                self._states[b] = old._states[b]
                self.version += 1
                self._windows[b] = old._windows[b]

    def degraded(self, branch: str) -> bool:
        state = self._states.get(branch)  # per branch per request: no default built
        return state is not None and state.degraded

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
        if (replay.by_text and not replay.text) or not self._scorers[replay.branch].can_score:
            return False  # nothing to replay, or a branch that cannot be compared (now)
        n = self.settings.max_tokens
        text = replay.text[: n * CHARS_PER_TOKEN] if replay.by_text else ""
        try:
            self._queue.put_nowait(replace(replay, tokens=replay.tokens[:n], text=text))
        except asyncio.QueueFull:
            return self._drop(replay.branch)
        return True

    def _drop(self, branch: str) -> bool:
        state = self.state(branch)
        self._states[branch] = replace(state, dropped=state.dropped + 1)
        return False

    # -- off the hot path ------------------------------------------------------

    @property
    def files(self) -> LogitsFiles:
        if self._files is None:  # made on first use: a monitor with nothing to watch never
            self._files = LogitsFiles()  # looks at the file system
        return self._files

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="drift-monitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        if self._reference:
            removed = await asyncio.to_thread(self.files.sweep)
            if removed:
                log.warning("drift: removed %d logits files left by a gateway that died", removed)
        while True:
            replay = await self._queue.get()
            try:
                await self.replay(replay)
            except Exception as exc:  # a failed replay says nothing about quality: skip it
                log.warning("drift: replay on %s failed: %s", replay.branch, exc)

    async def replay(self, replay: Replay) -> None:
        """Teacher-force one request through the reference (logits to a file), then the
        branch (compared in its worker, or for a remote one in a thread here); add the
        per-token results to its window. The file is deleted whatever happens; a failure
        raises and adds nothing."""
        ref_scorer = self._scorers[self._reference[replay.branch]]
        scorer = self._scorers[replay.branch]
        tokens = [] if replay.by_text else list(replay.tokens)
        limit = self.settings.max_tokens if replay.by_text else 0
        n_vocab = ref_scorer.info.n_vocab if ref_scorer.info is not None else 0
        path = self.files.new((len(tokens) or limit) * n_vocab * 4)
        try:
            if replay.by_text:  # the reference's tokens of a remote's answer
                ref = await ref_scorer.write_logits(
                    replay.prompt, [], path, parse_special=replay.parse_special,
                    text=replay.text, limit=limit,
                )  # fmt: skip
                tokens = list(ref.ids[len(ref.ids) - ref.n_tokens :])
            else:
                ref = await ref_scorer.write_logits(
                    replay.prompt, tokens, path, parse_special=replay.parse_special
                )
            scores = await scorer.score(
                replay.prompt, tokens, ref, parse_special=replay.parse_special
            )
        finally:
            # In a thread: freeing a large file's pages can take milliseconds. Shielded,
            # so that a cancelled replay still waits for its file to go.
            await asyncio.shield(asyncio.to_thread(path.unlink, missing_ok=True))
        state = self.state(replay.branch)
        self._states[replay.branch] = state = replace(state, replays=state.replays + 1)
        for mean_kld, top1, n in self._windows[replay.branch].add(scores.kld, scores.top1):
            self._close(replay.branch, mean_kld, top1, n)

    def _close(self, branch: str, mean_kld: float, top1: float, n: int) -> None:
        base = self._baselines.get(branch, Baseline())
        s = self.settings
        in_bounds = mean_kld <= base.mean_kld + s.kld_delta and top1 >= base.top1 - s.top1_delta
        before = self.state(branch)
        after = judge(before, WindowResult(mean_kld, top1, n, in_bounds), s)
        self._states[branch] = after
        if after.degraded != before.degraded:
            self.version += 1
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

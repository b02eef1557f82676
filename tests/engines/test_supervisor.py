"""``WorkerSupervisor`` on tiny real worker processes: restarts, and failing safely."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor
from quantroute.errors import EngineCrashedError, EngineUnavailableError

# A stand-in worker. argv: a file naming its behaviour (read at each spawn), and how
# long it lives once ready. It prints "ready" like the real one, and "fin" when it
# "finishes a generation".
WORKER = r"""
import os, resource, signal, sys, time
mode = open(sys.argv[1]).read().strip()
if mode == "exit-before-ready":
    sys.exit(3)
if mode == "hang-before-ready":
    time.sleep(60)
print("ready", flush=True)
if mode == "serve":
    for line in sys.stdin:
        if "shutdown" in line:
            break
    sys.exit(0)
if mode == "fin-then-sigill":
    print("fin", flush=True)
time.sleep(float(sys.argv[2]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.kill(os.getpid(), signal.SIGILL)
"""

SIGILL = -int(signal.SIGILL)
FAST = RestartPolicy(backoff_s=0.02, backoff_max_s=0.05, stop_grace_s=1.0)


class Harness:
    """One supervisor over the stand-in worker, recording what it was told."""

    def __init__(
        self,
        tmp_path: Path,
        mode: str,
        policy: RestartPolicy,
        *,
        linger_s: float,
        ready_s: float,
        warm_up_forever: bool,
    ):
        self._mode = tmp_path / "mode"
        self.set_mode(mode)
        self._ready_s = ready_s
        self._warm_up_forever = warm_up_forever
        self.spawns = 0
        self.exits: list[int] = []
        self.failures: list[str] = []
        self.spawned_at: list[float] = []
        self._readers: list[asyncio.Task[None]] = []
        self.sup = WorkerSupervisor(
            "tiny:q8_0",
            [sys.executable, "-c", WORKER, str(self._mode), str(linger_s)],
            on_start=self._on_start,
            on_exit=self.exits.append,
            on_failed=self.failures.append,
            policy=policy,
        )

    def set_mode(self, mode: str) -> None:
        self._mode.write_text(mode)

    async def _on_start(self, proc: asyncio.subprocess.Process) -> None:
        self.spawns += 1
        self.spawned_at.append(time.monotonic())
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), self._ready_s)
        if not line:
            raise RuntimeError("worker exited while loading")
        self._readers.append(asyncio.create_task(self._read(proc)))
        if self._warm_up_forever:  # a warm-up that waits for an answer a dead worker never sends
            await asyncio.Event().wait()

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            if line.strip() == b"fin":  # what the engine does when a generation finishes
                self.sup.note_healthy()

    async def close(self) -> None:
        await self.sup.stop()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)


Make = Callable[..., Harness]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[Harness] = []

    def factory(
        mode: str,
        policy: RestartPolicy = FAST,
        *,
        linger_s: float = 0.05,
        ready_s: float = 5.0,
        warm_up_forever: bool = False,
    ) -> Harness:
        made.append(
            Harness(
                tmp_path,
                mode,
                policy,
                linger_s=linger_s,
                ready_s=ready_s,
                warm_up_forever=warm_up_forever,
            )
        )
        return made[-1]

    yield factory
    for h in made:
        await h.close()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_a_crash_loop_fails_after_max_crashes_and_stops_restarting(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    h = make("sigill")
    await h.sup.start()  # ready: start() returns although every worker will crash
    assert not h.sup.failed
    await until(lambda: h.sup.failed)
    failure = h.sup.failure
    assert failure is not None
    assert failure.startswith("illegal instruction (SIGILL)")
    assert failure.endswith("(3 times in a row)")
    assert h.failures == [failure]
    assert h.exits == [SIGILL] * 3 and h.spawns == 3 and h.sup.restarts == 2
    await asyncio.sleep(0.5)  # ten times the longest backoff
    assert h.spawns == 3 and h.failures == [failure] and h.sup.failed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "tiny:q8_0" in errors[0].getMessage() and "SIGILL" in errors[0].getMessage()


async def test_restart_brings_a_failed_worker_back(make: Make) -> None:
    h = make("sigill", linger_s=0.3)
    await h.sup.start()
    await until(lambda: h.sup.failed)
    await h.sup.restart()
    assert h.spawns == 4 and not h.sup.failed and h.sup.failure is None
    # The count started again from zero: three more crashes fail it again.
    await until(lambda: h.sup.failed)
    assert h.spawns == 6 and len(h.failures) == 2


async def test_restart_of_a_failed_worker_that_now_works(make: Make) -> None:
    h = make("sigill")
    await h.sup.start()
    await until(lambda: h.sup.failed)
    h.set_mode("serve")
    await h.sup.restart()
    await asyncio.sleep(0.3)
    assert not h.sup.failed and h.spawns == 4
    assert h.sup.process is not None and h.sup.process.returncode is None


async def test_healthy_runs_between_crashes_prevent_failing(make: Make) -> None:
    h = make("fin-then-sigill")
    await h.sup.start()
    await until(lambda: len(h.exits) >= 6)
    assert h.exits[:6] == [SIGILL] * 6
    assert not h.sup.failed and h.failures == []


@pytest.mark.parametrize(
    ("mode", "ready_s", "code", "cause"),
    [
        ("exit-before-ready", 5.0, 3, "worker exited while loading (exited with status 3)"),
        ("hang-before-ready", 0.2, -int(signal.SIGKILL), "TimeoutError"),
    ],
)
async def test_failed_starts_count_too(
    make: Make, mode: str, ready_s: float, code: int, cause: str
) -> None:
    h = make(mode, ready_s=ready_s)
    with pytest.raises((RuntimeError, TimeoutError)):
        await h.sup.start()  # the first start failed: start() says so, and does not hang
    await until(lambda: h.sup.failed)
    assert h.sup.failure == f"{cause} (3 times in a row)"
    assert h.exits == [code] * 3 and h.failures == [h.sup.failure]


async def test_a_worker_that_dies_while_on_start_waits_fails_the_start(make: Make) -> None:
    h = make("sigill", warm_up_forever=True)
    with pytest.raises(EngineCrashedError):
        await asyncio.wait_for(h.sup.start(), 5.0)
    await until(lambda: h.sup.failed)
    assert h.sup.failure is not None
    assert h.sup.failure.startswith("illegal instruction (SIGILL)")  # the signal is the cause
    assert h.sup.failure.endswith("(3 times in a row)") and h.exits == [SIGILL] * 3


async def test_a_failed_supervisor_retries_every_failed_retry_s(make: Make) -> None:
    policy = RestartPolicy(backoff_s=0.02, backoff_max_s=0.05, failed_retry_s=0.6)
    h = make("sigill", policy)
    await h.sup.start()
    await until(lambda: h.sup.failed)
    failed_at = time.monotonic()
    await until(lambda: h.spawns == 4)
    assert h.spawned_at[3] - failed_at >= 0.5
    await until(lambda: len(h.exits) == 4)
    assert h.sup.failed and h.sup.failure is not None
    assert h.sup.failure.endswith("(4 times in a row)") and len(h.failures) == 1
    # The next try is healthy: the failure clears by itself.
    h.set_mode("fin-then-sigill")
    await until(lambda: not h.sup.failed)
    assert h.spawns == 5 and len(h.failures) == 1


@pytest.mark.parametrize(("stable_after_s", "fails"), [(0.1, False), (30.0, True)])
async def test_a_stable_run_resets_the_count(
    make: Make, stable_after_s: float, fails: bool
) -> None:
    policy = RestartPolicy(backoff_s=0.02, backoff_max_s=0.05, stable_after_s=stable_after_s)
    h = make("sigill", policy, linger_s=0.25)
    await h.sup.start()
    await until(lambda: len(h.exits) >= 3 or h.sup.failed)
    await asyncio.sleep(0.6)  # time for a fourth crash, had it not failed
    assert h.sup.failed is fails
    assert (len(h.exits) == 3) is fails


async def test_stop_while_failed_and_start_again(make: Make) -> None:
    h = make("sigill")
    await h.sup.start()
    await until(lambda: h.sup.failed)
    await asyncio.wait_for(h.sup.stop(), 2.0)
    h.set_mode("serve")
    await h.sup.start()  # a fresh start forgets the failure
    assert not h.sup.failed and h.spawns == 4


async def test_stop_and_restart_during_a_backoff_wait(make: Make) -> None:
    slow = RestartPolicy(backoff_s=30.0, backoff_max_s=30.0, stop_grace_s=1.0)
    h = make("sigill", slow)
    await h.sup.start()
    await until(lambda: len(h.exits) == 1)  # now sleeping 30 s
    await asyncio.wait_for(h.sup.restart(), 5.0)
    assert h.spawns == 2
    await until(lambda: len(h.exits) == 2)
    await asyncio.wait_for(h.sup.stop(), 2.0)
    assert h.spawns == 2


async def test_restart_kills_a_running_worker_and_reports_its_exit(make: Make) -> None:
    h = make("serve")
    await h.sup.start()
    first = h.sup.process
    assert first is not None
    await h.sup.restart()
    assert h.exits == [-int(signal.SIGKILL)] and first.returncode == -int(signal.SIGKILL)
    assert h.spawns == 2 and h.sup.process is not first and h.sup.restarts == 0


async def test_stop_shuts_a_worker_down_without_reporting_an_exit(make: Make) -> None:
    h = make("serve")
    await h.sup.start()
    proc = h.sup.process
    assert proc is not None
    await h.sup.stop()
    assert proc.returncode == 0 and h.exits == [] and h.spawns == 1


async def test_note_healthy_outside_a_run_does_nothing(make: Make) -> None:
    h = make("sigill")
    await h.sup.start()
    await until(lambda: h.sup.failed)
    h.sup.note_healthy()  # no worker is up: nothing to vouch for
    assert h.sup.failed


async def test_restart_while_a_start_is_in_progress(make: Make) -> None:
    h = make("hang-before-ready", ready_s=30.0)
    first = asyncio.create_task(h.sup.start())
    await until(lambda: h.spawns == 1)
    h.set_mode("serve")
    await asyncio.wait_for(h.sup.restart(), 5.0)
    with pytest.raises(EngineUnavailableError):
        await first  # that start was superseded: it ends, and does not hang
    assert h.exits == [-int(signal.SIGKILL)] and h.spawns == 2
    assert h.sup.process is not None and h.sup.process.returncode is None


async def test_a_stop_right_after_a_start_ends_that_start(make: Make) -> None:
    """Issue #32 H2b's cause: the loop task cancelled before its first step never ran its
    ``finally``, so the start (an operator's restart) waited for ever."""
    h = make("serve")
    start, stop = h.sup.start(), h.sup.stop()
    done = await asyncio.wait_for(asyncio.gather(start, stop, return_exceptions=True), 5.0)
    assert isinstance(done[0], EngineUnavailableError) and done[1] is None
    assert h.spawns == 0
    await asyncio.wait_for(h.sup.start(), 5.0)  # and it starts again afterwards
    assert h.spawns == 1


async def test_a_restart_with_a_stop_behind_it_answers(make: Make) -> None:
    h = make("serve")
    await h.sup.start()
    await h.sup.stop()  # a branch stopped (its file was replaced, say)
    done = await asyncio.wait_for(
        asyncio.gather(h.sup.restart(), h.sup.stop(), return_exceptions=True), 5.0
    )
    assert isinstance(done[0], EngineUnavailableError)


async def test_a_refused_file_fails_the_supervisor_at_once_in_its_words(tmp_path: Path) -> None:
    """``prepare`` refusing (the file is not the verified one): no spawn, no retry, failed
    once with exactly that cause; a restart checks again, and a good launch runs."""
    from quantroute.engines.supervisor import Launch
    from quantroute.errors import ArtifactIntegrityError

    mode = tmp_path / "mode"
    mode.write_text("serve")
    refuse = ["its file main.gguf changed on disk since it was verified"]
    failures: list[str] = []
    exits: list[int] = []
    fds: list[int] = []

    async def prepare() -> Launch:
        if refuse:
            raise ArtifactIntegrityError(refuse[0])
        r, w = os.pipe()
        os.write(w, b"launched")
        os.close(w)
        fds.append(r)
        argv = [sys.executable, "-c", f"import os; os.read({r}, 8)\n" + WORKER, str(mode), "1"]
        return Launch(tuple(argv), (r,))

    async def on_start(proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 5.0) == b"ready\n"

    sup = WorkerSupervisor(
        "tiny:main",
        ["/nonexistent"],
        on_start=on_start,
        on_exit=exits.append,
        on_failed=failures.append,
        policy=RestartPolicy(backoff_s=0.01, max_crashes=3),
        prepare=prepare,
    )
    try:
        with pytest.raises(ArtifactIntegrityError):
            await asyncio.wait_for(sup.start(), 5.0)
        await until(lambda: sup.failed)
        await asyncio.sleep(0.1)
        assert sup.failure == refuse[0] and failures == [refuse[0]] and sup.restarts == 0
        assert exits == [] and sup.process is None  # nothing was spawned, so nothing exited
        refuse.clear()
        await asyncio.wait_for(sup.restart(), 5.0)  # the descriptor reached the worker
        assert not sup.failed and sup.process is not None and sup.process.returncode is None
    finally:
        await sup.stop()
        for fd in fds:
            os.close(fd)

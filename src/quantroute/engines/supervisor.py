"""Starts a worker process, watches it, restarts it with backoff, and gives up on one
that keeps failing.

The supervisor owns one process at a time. When the process exits without
being asked to, ``on_exit`` is told (so in-flight requests get a clean
error), then the supervisor waits ``backoff`` (doubling up to a cap) and
starts a new one. Nothing a worker does can raise into the gateway: a worker
that will not start is retried, and logged.

A worker that fails ``max_crashes`` times in a row, with no healthy run in
between, fails the supervisor: ``failure`` says why in words (a CPU that
lacks an instruction the llama.cpp build uses makes every worker die of
SIGILL at its first decode; restarting it forever helps no one),
``on_failed`` is told once, and restarting stops until :meth:`restart`, or
slows to one try every ``failed_retry_s``. A run is healthy once the engine
calls :meth:`WorkerSupervisor.note_healthy` or once it has lasted
``stable_after_s``; being ready is not enough.

Before each spawn the owner's ``prepare`` (if any) says what to run: the argv
and the descriptors the worker inherits (``Launch``: the engine's model file,
opened and checked, ``registry.verified``). A ``prepare`` or a start that
raises :class:`~quantroute.errors.ArtifactIntegrityError` is a *refusal*: the
file is not the verified one, and no retry would change that, so the
supervisor is failed at once, in those words (a ``failed_retry_s`` retry checks
again).

Every path that ends a loop resolves the start a caller waits for: a loop task
cancelled before it ran (a stop right after a start) never reaches its own
``finally``, so :meth:`WorkerSupervisor._end_loop` resolves it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from quantroute.engines.exits import crashed, describe_exit
from quantroute.errors import ArtifactIntegrityError, EngineCrashedError, EngineUnavailableError
from quantroute.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# How long a failing start gets to settle by itself: on_start to notice that its worker
# died, or a worker whose start failed (its stdout closed) to finish exiting.
_SETTLE_S = 0.5


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 30.0  # a run ready this long is healthy: it resets the count
    stop_grace_s: float = 5.0
    max_crashes: int = 3  # failures in a row that fail the supervisor; 0 never gives up
    failed_retry_s: float = 0.0  # once failed, try again this often; 0 waits for restart()

    def delay(self, failures: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(failures - 1, 0)))


@dataclass(frozen=True, slots=True)
class Launch:
    """What one spawn runs: ``argv``, and ``pass_fds``, descriptors the worker inherits
    (the caller keeps and closes its own copies)."""

    argv: tuple[str, ...]
    pass_fds: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Ended:
    """How one run ended: the exit status, and the start's error if it never got ready."""

    code: int
    start_error: Exception | None = None
    killed: bool = False  # the start failed with the process running: we killed it
    killed_because: str | None = None  # its owner killed it (:meth:`WorkerSupervisor.kill`)

    @property
    def refused(self) -> bool:
        """Its file was not the verified one: no retry helps (see the module docstring)."""
        return isinstance(self.start_error, ArtifactIntegrityError)

    @property
    def failed(self) -> bool:
        return self.start_error is not None or self.code != 0

    def cause(self) -> str:
        if self.killed_because is not None and self.code == -signal.SIGKILL:
            return f"killed by the gateway: {self.killed_because}"
        if self.start_error is None:
            return describe_exit(self.code)
        if self.refused:
            return str(self.start_error)
        if crashed(self.code) and not (self.killed and self.code == -signal.SIGKILL):
            return describe_exit(self.code)  # it died of a signal while starting: that is why
        words = str(self.start_error) or type(self.start_error).__name__
        if self.code != 0 and not (self.killed and self.code == -signal.SIGKILL):
            words += f" ({describe_exit(self.code)})"  # it died by itself: say how
        return words


class WorkerSupervisor:
    """Keeps one worker process alive, and fails safely when it cannot.

    ``on_start(process)`` is awaited after each spawn and must return once the
    worker is ready (or raise); ``on_exit(returncode)`` runs whenever a worker
    goes away other than by :meth:`stop` (a failed start included; a file
    ``prepare`` refused spawns no worker, and only ``on_failed`` is told);
    ``on_failed(failure)`` runs once each time the supervisor becomes failed.

    Example::

        sup = WorkerSupervisor("m:q8_0", argv, on_start=ready, on_exit=lost,
                               policy=RestartPolicy(), on_failed=fail_branch)
        await sup.start()    # ready, or the first start failed (never hangs)
        sup.note_healthy()   # a generation finished: this run is healthy
        sup.failure          # 'illegal instruction (SIGILL): ... (3 times in a row)'
        await sup.restart()  # operator: forget the failure, start a fresh worker
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        on_start: Callable[[asyncio.subprocess.Process], Awaitable[None]],
        on_exit: Callable[[int], None],
        policy: RestartPolicy,
        env: dict[str, str] | None = None,
        on_failed: Callable[[str], None] | None = None,
        prepare: Callable[[], Awaitable[Launch]] | None = None,
    ):
        self.name = name
        self.argv = list(argv)  # read at each spawn: a change applies from the next one
        self.env = env
        self._prepare = prepare
        self._on_start = on_start
        self._on_exit = on_exit
        self._on_failed = on_failed
        self._policy = policy
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # start, stop and restart do not interleave
        self._stopping = False
        self._running = False  # self.process was spawned and its end is not yet handled
        self._healthy = False  # ... and it has proved itself healthy
        self._failures = 0  # failed runs in a row, with no healthy run between
        self._causes: set[str] = set()  # the causes of those failures
        self.failure: str | None = None
        self._kill_cause: str | None = None  # why the owner killed the current worker
        """Why the supervisor gave up, in words; ``None`` while it is not failed."""
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0  # automatic restarts (operator restarts are not counted)
        self.first_start: asyncio.Future[None] | None = None

    @property
    def stopping(self) -> bool:
        """A stop is under way (the worker was told to shut down, or is being killed)."""
        return self._stopping

    @property
    def failed(self) -> bool:
        """The worker failed ``max_crashes`` times in a row and has not been healthy since."""
        return self.failure is not None

    async def start(self) -> None:
        """Spawn the first worker and wait until it is ready (or failed once).
        A stopped supervisor can be started again (the residency manager does);
        each start begins afresh, with no failure and no count."""
        async with self._lock:
            first = self._begin()
        await asyncio.shield(first)

    async def restart(self) -> None:
        """Operator action: forget the failure and the count, and start a fresh worker
        now. A running worker is killed first (``on_exit`` is told, so its requests
        fail cleanly); a backoff wait is cut short. Safe at any time; waits and
        raises like :meth:`start`."""
        async with self._lock:
            await self._end_loop()
            await self._kill_current()
            first = self._begin()
        log.info("%s: restarting the worker (operator request)", self.name)
        await asyncio.shield(first)

    async def stop(self) -> None:
        async with self._lock:
            self._stopping = True
            proc = self.process
            if proc is not None and proc.returncode is None:
                if proc.stdin is not None:
                    with contextlib.suppress(Exception):
                        proc.stdin.write(b'{"op":"shutdown"}\n')
                        proc.stdin.close()
                try:
                    await asyncio.wait_for(proc.wait(), self._policy.stop_grace_s)
                except TimeoutError:
                    log.warning("%s: worker did not stop in time; killing it", self.name)
                    _kill(proc)
                    await proc.wait()
            await self._end_loop()
            self._running = False

    def kill(self, cause: str) -> None:
        """Kill the current worker because its owner gave up on it (it stopped answering,
        its output could not be read); the run counts as a failure, in these words."""
        proc = self.process
        if proc is not None and proc.returncode is None:
            self._kill_cause = cause
            _kill(proc)

    def note_healthy(self) -> None:
        """The current worker did its job (the engine calls this when a generation
        finishes normally, a warm-up's included): its run resets the failure count,
        and clears a failure. With no worker running it does nothing."""
        if not self._running or self._healthy:
            return
        self._healthy = True
        self._failures = 0
        self._causes.clear()
        if self.failure is not None:
            log.warning("%s: worker healthy again; no longer failed", self.name)
            self.failure = None

    # -- the loop ---------------------------------------------------------------

    def _begin(self) -> asyncio.Future[None]:
        self._stopping = False
        self._failures = 0
        self._causes.clear()
        self.failure = None
        self.first_start = first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.name}")
        return first

    async def _end_loop(self) -> None:
        try:
            await cancel_and_wait(self._task)
        finally:  # a cancel of the caller too: the loop is cancelled all the same
            self._task = None
            # a task cancelled before its first step never runs _supervise's ``finally``:
            # whoever waits for this loop's first start must not wait for ever
            self._resolve_first(EngineUnavailableError("stopped before the worker was ready"))

    async def _kill_current(self) -> None:
        proc = self.process
        if proc is None or not self._running:
            return
        _kill(proc)
        code = await proc.wait()
        self._running = False
        self._on_exit(code)

    async def _supervise(self) -> None:
        try:
            while not self._stopping:
                ended = await self._run_once()
                if self._stopping:
                    return
                self._running = False
                if self.process is not None or not ended.refused:  # a refusal spawns nothing
                    self._on_exit(ended.code)
                delay = self._count(ended)
                if delay is None:
                    return
                self.restarts += 1
                await asyncio.sleep(delay)
        finally:
            self._resolve_first(EngineUnavailableError("stopped before the worker was ready"))

    async def _run_once(self) -> _Ended:
        self.process = None
        self._healthy = False
        self._kill_cause = None
        try:
            launch = await self._prepare() if self._prepare is not None else Launch(())
            self.process = proc = await asyncio.create_subprocess_exec(
                *(launch.argv or self.argv),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=self.env,
                limit=1 << 24,
                pass_fds=launch.pass_fds,
            )
            self._running = True
            await self._start(proc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the cause is logged once counted (see _count)
            self._resolve_first(exc)
            if self.process is None:
                return _Ended(-1, exc)
            proc = self.process
            killed = False
            if proc.returncode is None:  # often it is exiting already: let it say how
                try:
                    await asyncio.wait_for(proc.wait(), _SETTLE_S)
                except TimeoutError:
                    killed = True
                    _kill(proc)
            return _Ended(await proc.wait(), exc, killed=killed, killed_because=self._kill_cause)
        self._resolve_first(None)
        try:
            code = await asyncio.wait_for(proc.wait(), self._policy.stable_after_s)
        except TimeoutError:
            self.note_healthy()  # a stable run
            code = await proc.wait()
        return _Ended(code, killed_because=self._kill_cause)

    async def _start(self, proc: asyncio.subprocess.Process) -> None:
        """Await ``on_start``; a worker that dies meanwhile fails the start even where
        ``on_start`` would not notice (a warm-up request waiting on a dead worker)."""
        starting = asyncio.ensure_future(self._on_start(proc))
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait((starting, exited), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # it died: on_start's own error would say more
                await asyncio.wait((starting,), timeout=_SETTLE_S)
            if not starting.done():
                raise EngineCrashedError("the worker died while starting")
            starting.result()  # on_start's own error, if it raised one
        finally:  # (not awaited: a cancellation of ours must not be swallowed there)
            starting.cancel()
            exited.cancel()

    def _count(self, ended: _Ended) -> float | None:
        """Count the run that ended; return how long to wait before the next, or None
        to stop restarting."""
        policy = self._policy
        if ended.failed:
            self._failures += 1
            cause = ended.cause()
            self._causes.add(cause)
            if ended.refused:
                self._fail(cause, refused=True)
            elif 0 < policy.max_crashes <= self._failures:
                self._fail(cause)
        if self.failure is None:
            delay = policy.delay(self._failures)
            if ended.failed:
                of = f" of {policy.max_crashes}" if policy.max_crashes > 0 else ""
                what = f"failed: {ended.cause()} (failure {self._failures}{of} in a row)"
            else:
                what = "exited"
            log.warning("%s: worker %s; restarting in %.1fs", self.name, what, delay)
            return delay
        if policy.failed_retry_s > 0:
            log.warning(
                "%s: still failed: %s; trying again in %.0fs",
                self.name,
                self.failure,
                policy.failed_retry_s,
            )
            return policy.failed_retry_s
        return None

    def _fail(self, cause: str, *, refused: bool = False) -> None:
        n = self._failures
        times = "once" if n == 1 else f"{n} times in a row"
        if len(self._causes) > 1:
            times = f"the last of {n} failures in a row"
        already = self.failure is not None
        self.failure = cause if refused else f"{cause} ({times})"
        if already:  # a slow retry failed again: the words stay current, the alarm once
            return
        retry = (
            f"trying again every {self._policy.failed_retry_s:.0f}s"
            if self._policy.failed_retry_s > 0
            else "not restarting it until an operator restarts it"
        )
        log.error("%s: worker failed: %s; %s", self.name, self.failure, retry)
        if self._on_failed is not None:
            self._on_failed(self.failure)

    def _resolve_first(self, exc: BaseException | None) -> None:
        if self.first_start is not None and not self.first_start.done():
            if exc is None:
                self.first_start.set_result(None)
            else:
                self.first_start.set_exception(exc)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL ``proc`` if it has not been reaped. Not ``Process.kill``: that polls
    first, and a child it reaps there is lost to asyncio's child watcher, which then
    reports exit status 255 instead of the real one."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)

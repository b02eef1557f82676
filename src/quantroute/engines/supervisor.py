"""Starts a worker process, watches it, and restarts it with backoff.

The supervisor owns one process at a time. When the process exits without
being asked to, ``on_exit`` is told (so in-flight requests get a clean
error), then the supervisor waits ``backoff`` (doubling up to a cap, reset
after a stable run) and starts a new one. Nothing a worker does can raise
into the gateway: a worker that will not start is retried, and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 30.0  # a run this long resets the backoff
    stop_grace_s: float = 5.0

    def delay(self, failures: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(failures - 1, 0)))


class WorkerSupervisor:
    """Keeps one worker process alive.

    ``on_start(process)`` is awaited after each spawn and must return once the
    worker is ready (or raise); ``on_exit(returncode)`` runs when it dies.
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
    ):
        self.name = name
        self._argv = list(argv)
        self._on_start = on_start
        self._on_exit = on_exit
        self._policy = policy
        self._env = env
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.first_start: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Spawn the first worker and wait until it is ready (or failed once).
        A stopped supervisor can be started again (the residency manager does)."""
        self._stopping = False
        self.first_start = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.name}")
        await asyncio.shield(self.first_start)

    async def stop(self) -> None:
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
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            self.process = None
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *self._argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    env=self._env,
                    limit=1 << 24,
                )
                await self._on_start(self.process)
                self._resolve_first(None)
                code = await self.process.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.error("%s: worker failed to start: %s", self.name, exc)
                self._resolve_first(exc)
                if self.process is not None and self.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.process.kill()
                    await self.process.wait()
                returncode = self.process.returncode if self.process is not None else None
                code = -1 if returncode is None else returncode
            if self._stopping:
                return
            self._on_exit(code)
            failures = (
                1 if time.monotonic() - started > self._policy.stable_after_s else failures + 1
            )
            delay = self._policy.delay(failures)
            log.warning("%s: worker exited with %s; restarting in %.1fs", self.name, code, delay)
            self.restarts += 1
            await asyncio.sleep(delay)

    def _resolve_first(self, exc: BaseException | None) -> None:
        if self.first_start is not None and not self.first_start.done():
            if exc is None:
                self.first_start.set_result(None)
            else:
                self.first_start.set_exception(exc)

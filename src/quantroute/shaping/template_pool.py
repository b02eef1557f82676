"""Render processes for chat templates that are not provably bounded.

A thread cannot be stopped in the middle of one C-level operation, and holds
the GIL through it: a template that formats, pads or multiplies its way to
seconds in C would hold the gateway's event loop too. So such a template
renders in a separate process (:mod:`~quantroute.shaping.template_worker`)
that the gateway can kill. A :class:`TemplatePool` keeps a few of them,
long-lived (a render costs a pipe's round trip, not a process start):

- each render runs under the sandbox's budget *and* its process's memory
  limit (``max_bytes`` more than it uses when the render starts); the
  gateway waits ``timeout_s`` and a little more, then kills the process and
  answers ``time``; a process that dies answers ``memory``. A killed or
  dead process is replaced, lazily, by the next render;
- the pool's threads only wait on pipes: one per process, so renders queue
  when every process is busy, and none of them holds the GIL while it waits.

The pool is created on first use and closed with :meth:`TemplatePool.close`
(the gateway's stop); its processes also exit when the gateway does (their
stdin closes; on Linux they are killed with it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import select
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quantroute.engines.environment import worker_env
from quantroute.errors import TemplateError
from quantroute.shaping.template_sandbox import LimitExceeded
from quantroute.shaping.template_worker import ARGV, RenderJob, decode_reply, read_frame

__all__ = ["DEFAULT_SIZE", "KILL_SLACK_S", "TemplatePool", "close_default_pool", "default_pool"]

logger = logging.getLogger(__name__)

DEFAULT_SIZE = max(2, min(4, os.cpu_count() or 1))
#: How long past a render's own deadline the gateway waits before it kills the process.
KILL_SLACK_S = 0.25
_START_TIMEOUT_S = 30.0


def _child_env() -> dict[str, str]:
    """The workers' allowlist (``engines.environment``): a render process needs Python's
    paths and the locale, no keys."""
    return worker_env(os.environ)


class _Process:
    """One render process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [*ARGV, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_child_env(),
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin
        self._out = self.proc.stdout
        self.renders = 0
        # Wait for its imports: a render's deadline counts the render, not the start.
        ready, _, _ = select.select([self._out.fileno()], [], [], _START_TIMEOUT_S)
        hello = read_frame(self._out) if ready else None
        if not hello or hello.get("ready") is not True:
            self.kill()
            raise TemplateError("a chat template render process did not start")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def render(self, job: RenderJob, wall_s: float) -> dict[str, Any]:
        """Send ``job``, wait for its reply at most ``wall_s``; kills the process and
        raises :class:`LimitExceeded` on a timeout or death."""
        deadline = time.monotonic() + wall_s
        try:
            self._in.write(job.encode())
            self._in.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise LimitExceeded(self._why_dead()) from None
        fd = self._out.fileno()
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))
            if ready:
                break
            if left <= 0:
                self.kill()
                raise LimitExceeded("time")
        # The reply is on its way: the rest of the frame follows at pipe speed.
        reply = read_frame(self._out)
        if reply is None:
            self.kill()
            raise LimitExceeded(self._why_dead())
        self.renders += 1
        if reply.get("recycle"):
            self.kill()
        return reply

    def _why_dead(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "memory"
        return "time" if code == -24 else "memory"  # SIGXCPU: its CPU limit

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for pipe in (self._in, self._out):
            with contextlib.suppress(OSError):
                pipe.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            logger.warning("template render process %d did not exit", self.proc.pid)


class TemplatePool:
    """A few long-lived render processes (see the module docstring)."""

    def __init__(self, size: int = DEFAULT_SIZE):
        self.size = size
        self._executor = ThreadPoolExecutor(size, thread_name_prefix="qr-template")
        self._lock = threading.Lock()
        self._idle: list[_Process] = []
        self._all: set[_Process] = set()
        self._closed = False
        self.started = 0  # processes started so far (a killed one is replaced)
        self.killed = 0  # processes killed at a render's deadline or dead of it

    async def render(self, job: RenderJob) -> str:
        """``job``'s prompt text, rendered in a render process; raises what the
        sandbox raises (``template_sandbox``'s exceptions)."""
        if self._closed:
            raise RuntimeError("the template pool is closed")
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self._executor, self._render, job)
        return decode_reply(reply)

    def _render(self, job: RenderJob) -> dict[str, Any]:
        process = self._take()
        try:
            reply = process.render(job, job.timeout_s + KILL_SLACK_S)
        except LimitExceeded:
            self._drop(process, killed=True)
            raise
        except BaseException:
            self._drop(process, killed=True)
            process.kill()
            raise
        if process.alive:
            with self._lock:
                if not self._closed:
                    self._idle.append(process)
                    return reply
        self._drop(process, killed=False)
        process.kill()
        return reply

    def _take(self) -> _Process:
        with self._lock:
            while self._idle:
                process = self._idle.pop()
                if process.alive:
                    return process
                self._all.discard(process)
            if self._closed:
                raise RuntimeError("the template pool is closed")
        process = _Process()
        with self._lock:
            self._all.add(process)
            self.started += 1
        return process

    def _drop(self, process: _Process, *, killed: bool) -> None:
        with self._lock:
            self._all.discard(process)
            if killed:
                self.killed += 1

    def warm(self) -> None:
        """Start the pool's processes now (blocking; in a thread), so that the first
        renders do not wait for them."""
        started = [self._take() for _ in range(self.size - len(self._idle))]
        with self._lock:
            self._idle.extend(started)

    def close(self) -> None:
        """Kill every process and stop the threads; idempotent."""
        with self._lock:
            self._closed = True
            processes = list(self._all)
            self._all.clear()
            self._idle.clear()
        for process in processes:
            process.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.proc.pid for p in self._all]


_DEFAULT: list[TemplatePool] = []  # at most one: the process's pool, made on first use
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> TemplatePool:
    """The process's template pool, started on first use and closed at exit (or by
    :func:`close_default_pool`, which the gateway's stop calls)."""
    with _DEFAULT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(TemplatePool())
        return _DEFAULT[0]


def close_default_pool() -> None:
    """Close the process's template pool, if there is one; the next render starts a
    new one."""
    with _DEFAULT_LOCK:
        pools = list(_DEFAULT)
        _DEFAULT.clear()
    for pool in pools:
        pool.close()


atexit.register(close_default_pool)

"""Draining the branches a reload replaced, in the background.

A reload swaps the route table and hands the branches it replaced to
:class:`Drains`; the reload lock is released at the swap, so the next reload
(or the watcher) never waits for a drain. Each drain waits until nothing has
been in flight on its branches for ``repository.drain_quiet_s`` (at most
``drain_timeout_s``), then stops their workers. Every replaced worker is
stopped exactly once: by its drain, which takes it off the draining list
before it stops it. :meth:`Drains.close` (the gateway stopping) cuts every
wait short and waits for the drains to stop what they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from quantroute.routing.table import Branch, RouteTableRef

log = logging.getLogger(__name__)

_POLL_S = 0.05
T = TypeVar("T")


class Drains:
    """The drains of ``routes``' replaced branches. ``forget(branch_id)``: an id the table
    no longer serves loses its placement and residency (the composition root's);
    ``quiet_s`` and ``timeout_s``: ``repository.drain_quiet_s`` and ``drain_timeout_s``."""

    def __init__(
        self,
        routes: RouteTableRef,
        forget: Callable[[str], None],
        *,
        quiet_s: float,
        timeout_s: float,
        lock: asyncio.Lock | None = None,
    ):
        self._routes = routes
        self._forget = forget
        self._quiet_s = quiet_s
        self._timeout_s = timeout_s
        # the reloads' lock: a drain forgets an id's placement only between reloads, never
        # while one is placing and starting a new worker for that id
        self._lock = lock or asyncio.Lock()
        self._draining: list[Branch] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()

    @property
    def branches(self) -> list[Branch]:
        """The replaced branches whose workers are not stopped yet."""
        return list(self._draining)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` (a reload's drain and its report) as a task :meth:`close` waits for."""
        task = asyncio.get_running_loop().create_task(coro, name="reload-drain")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: never silent
            log.error("reload: a drain failed", exc_info=task.exception())

    async def drain(self, retired: Sequence[Branch]) -> int:
        """Wait for ``retired``'s requests to finish, then stop their workers; how many."""
        mine = list(retired)
        self._draining += mine
        deadline = time.monotonic() + self._timeout_s
        quiet_since: float | None = None
        try:
            while not self._closing.is_set():
                now = time.monotonic()
                busy = sum(b.engine.in_flight for b in mine)
                if busy:
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = now
                if quiet_since is not None and now - quiet_since >= self._quiet_s:
                    break
                if now >= deadline:
                    log.warning(
                        "reload: %d requests still on the replaced branches after %.0f s; "
                        "stopping them",
                        busy,
                        self._timeout_s,
                    )
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), _POLL_S)
        finally:
            await asyncio.shield(self._stop(mine))
        return len(mine)

    async def _stop(self, branches: list[Branch]) -> None:
        for b in branches:
            if b not in self._draining:
                continue  # already stopped
            self._draining.remove(b)  # before the await: nobody else stops it
            try:
                await b.engine.stop()
            except Exception:
                log.exception("reload: stopping the replaced %s failed", b.id)
            # an id the table serves now (a later reload may have brought it back) keeps
            # its placement; the others' go, decided between reloads
            async with self._lock:
                if b.id not in {x.id for x in self._routes.current.branches()}:
                    self._forget(b.id)

    async def close(self) -> None:
        """The gateway is stopping: every drain stops its workers now; wait for them."""
        self._closing.set()
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop(list(self._draining))  # a drain whose task never ran

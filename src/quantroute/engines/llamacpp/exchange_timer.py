"""One exchange's timeouts with the worker on one loop timer, not one per event.

``LlamaCppEngine._exchange`` bounds a request's wait for its next event
(``idle_s``) and, for a scoring command, its whole run (``total_s``). An
``asyncio.timeout`` around every wait costs a timer per streamed token (about
7 µs of the gateway's CPU each, measured); this arms one timer per exchange
and moves it on lazily: when it fires early (the request was not waiting, or
began waiting later) it re-arms for the new due time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["ExchangeTimer"]


class ExchangeTimer:
    """``expired`` (the wait, in seconds, that ran out) is set, and ``wake`` called,
    once ``total_s`` has passed since the start, or ``idle_s`` since the consumer began
    waiting (:meth:`waiting`) without an event (:meth:`got`). :meth:`cancel` at the end."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_s: float | None,
        total_s: float | None,
        wake: Callable[[], None],
    ):
        self._loop = loop
        self._idle_s = idle_s
        self._total_s = total_s
        self._deadline = None if total_s is None else loop.time() + total_s
        self._since: float | None = None  # the consumer waits on an empty queue from then
        self._wake = wake
        self.expired: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._arm(loop.time())

    def wait_s(self) -> float | None:
        """The longest the next wait may take: for a write that must not hang either."""
        waits = [] if self._idle_s is None else [self._idle_s]
        if self._deadline is not None:
            waits.append(max(0.0, self._deadline - self._loop.time()))
        return min(waits) if waits else None

    def waiting(self) -> None:
        self._since = self._loop.time()

    def got(self) -> None:
        self._since = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, now: float) -> None:
        dues = [] if self._deadline is None else [self._deadline]
        if self._idle_s is not None:
            dues.append((now if self._since is None else self._since) + self._idle_s)
        self._handle = self._loop.call_at(min(dues), self._fire) if dues else None

    def _fire(self) -> None:
        now = self._loop.time()
        if self._deadline is not None and now >= self._deadline:
            self.expired = self._total_s
        elif (
            self._idle_s is not None
            and self._since is not None
            and now >= self._since + self._idle_s
        ):
            self.expired = self._idle_s
        if self.expired is None:
            self._arm(now)
            return
        self._handle = None
        self._wake()

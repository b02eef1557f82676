"""A request's items from a worker, in order, and the two ways to read them.

The engine's reader task puts each item (an event, or the error that ends the
request); the request's reader either waits for the next one (:meth:`Inbox.get`)
or takes whatever has come (``items``) and is told, by ``notify``, when more
arrives while it waits for nothing: a push source, so a stream's consumer
needs no task of its own to wait on the engine (``api/run.py``: ``Run``)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    __slots__ = ("_waiter", "items", "notify")

    def __init__(self) -> None:
        self.items: deque[T] = deque()
        self.notify: Callable[[], None] | None = None  # told of an item nobody waits for
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self.items)

    def put_nowait(self, item: T) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        elif self.notify is not None:
            self.notify()

    async def get(self) -> T:
        """The next item, waiting for it if none has come."""
        while not self.items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled, not woken
                    self._waiter = None
        return self.items.popleft()

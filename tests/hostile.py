"""What the security tests share: how long the event loop stood still while a coroutine
ran, and a file rewritten in place with its old mtime put back (issue 32's H2a)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any


async def loop_gaps(coro: Any, tick_s: float = 0.001) -> tuple[Any, float]:
    """``coro``'s outcome (its result, or the exception it raised) and the longest the
    event loop stood still meanwhile, seen by a task ticking every ``tick_s``."""
    gaps = [0.0]

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            gaps[0] = max(gaps[0], now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(tick_s)
    try:
        try:
            result: Any = await coro
        except Exception as exc:
            result = exc
    finally:
        task.cancel()
    return result, gaps[0]


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Other bytes into the same inode, its mtime set back: what H2a did."""
    st = path.stat()
    with path.open("r+b") as fh:
        fh.write(data)
        fh.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

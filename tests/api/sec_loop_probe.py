"""Times ``/healthz`` of a live server from another thread (tests of issue #32, section 1).

From another thread, not from a task of the server's own loop: a task that is asleep
when the loop stalls starts its next request after the stall and times it short. A
thread asleep when a C call holds the GIL (a regular expression does) wakes only after
it too, so each sample is the longer of the request's time and the gap since the last
answer, less the pause between probes: a stall shows whichever way it holds the probe."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import httpx


@contextlib.asynccontextmanager
async def healthz_timed(port: int, every_s: float = 0.01) -> AsyncIterator[list[float]]:
    """While inside: ``/healthz`` on ``port`` every ``every_s``; the list of latencies (s)
    fills as they come (and once more at the end: a stall still in flight counts).

    The thread is joined from another thread: the server runs on the caller's loop, and
    a probe in flight when it stops needs that loop to answer it."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            last = time.perf_counter()
            while not stop.is_set():
                start = time.perf_counter()
                assert http.get("/healthz").status_code == 200
                end = time.perf_counter()
                latencies.append(max(end - start, end - last - every_s))
                last = end
                stop.wait(every_s)

    thread = threading.Thread(target=probe, name="healthz-probe", daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 130)

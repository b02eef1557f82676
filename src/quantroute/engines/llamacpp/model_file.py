"""The model file a llama.cpp worker loads: only the bytes that were verified (gateway
side; ``registry.verified``).

Before each spawn the engine opens the file and checks the descriptor against the
verification (a file that changed is refused: the branch fails, in words); the worker
loads that descriptor (``/proc/self/fd/N``), and the engine keeps it open while the
worker lives, to find a rewrite in place (:meth:`ModelFile.moved`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from quantroute.registry.verified import VerifiedFile


class ModelFile:
    """A branch's verified file and the descriptor its current worker loaded."""

    def __init__(self, verified: VerifiedFile):
        self._verified = verified
        self._fd: int | None = None  # the open file the current worker loaded

    async def open(self) -> int:
        """Open the file and prove it holds the verified bytes (in a thread: it may read
        the whole file); the descriptor stays open until :meth:`release`. Raises what
        :meth:`VerifiedFile.open` raises for a file that changed."""
        self.release()
        opening = asyncio.ensure_future(asyncio.to_thread(self._verified.open))
        try:
            fd, self._verified = await asyncio.shield(opening)
        except asyncio.CancelledError:  # a stop during the check: close what it opens
            opening.add_done_callback(_close_opened)
            raise
        self._fd = fd
        return fd

    def release(self) -> None:
        """Close the descriptor (the worker that loaded it is gone)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def moved(self) -> str | None:
        """Why the file the running worker loaded is no longer the verified one (it was
        rewritten in place), in words; ``None`` while it holds or nothing is open."""
        return None if self._fd is None else self._verified.moved(self._fd)


def _close_opened(opening: asyncio.Future[tuple[int, VerifiedFile]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        with contextlib.suppress(OSError):
            os.close(opening.result()[0])

"""Watch the model repository and call back once it has been quiet for a while.

The way to replace a file while serving is to write it under a temporary
name and rename it into place (``x.gguf.tmp`` → ``x.gguf``): the rename is
atomic, and workers that have the old file open keep the old inode. Changes
to temporary files (``*.tmp``, ``*.part``, ``*.partial``, ``*.swp``, ``*~``,
and hidden files such as ``.x.gguf.swp``) are ignored; the rename itself is
the change that counts. Changes are debounced: the callback runs once
``debounce_ms`` passed without another change, so copying a model's three
files and its manifest is one reload, not four.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".swp", ".swx", ".crdownload", "~")


def is_temporary(path: Path) -> bool:
    """Files a reload never looks at: being written, or an editor's."""
    name = path.name
    return name.startswith((".", "#")) or name.endswith(TEMP_SUFFIXES)


async def watch_repository(
    repo: Path,
    on_change: Callable[[str], Awaitable[Any]],
    debounce_ms: int = 1000,
    *,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Call ``on_change(trigger)`` after every quiet burst of changes under ``repo``
    (``trigger`` names the files, for the report). Runs until cancelled or
    ``stop_event`` is set; a failing callback is logged and watching goes on."""
    from watchfiles import awatch

    log.info("watching %s for model changes (debounce %d ms)", repo, debounce_ms)
    async for changes in awatch(
        repo,
        watch_filter=lambda _change, path: not is_temporary(Path(path)),
        step=debounce_ms,  # quiet time that ends a burst
        debounce=max(10 * debounce_ms, 30_000),  # the longest burst grouped into one
        stop_event=stop_event,
        recursive=True,
    ):
        names = sorted({Path(p).name for _, p in changes})
        trigger = "watch: " + ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        try:
            await on_change(trigger)
        except Exception:
            log.exception("reload after %s failed", trigger)

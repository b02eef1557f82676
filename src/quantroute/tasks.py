"""Ending a background task: cancel it, wait for its end, and let the caller's own
cancellation through.

``with suppress(CancelledError): await task`` (the usual idiom) cannot tell the task's
cancellation from its caller's: a ``stop()`` cancelled while it waits swallows that
cancel and carries on, and a task that ended with an error raises it out of ``stop()``,
leaving what ``stop()`` had still to close open. A leaf module: nothing of quantroute's
is imported, so engines and workers may use it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (nothing when ``None`` or already done) and wait until it has ended.

    A cancellation of the caller while it waits is raised in the caller, as any await
    would (the task goes on ending by itself). The task's own ending is never raised:
    its cancellation is what was asked for, and an error it ended with is logged."""
    if task is None:
        return
    if not task.done():  # (a done one is not waited for: no turn of the loop)
        task.cancel()
        await asyncio.wait({task})  # its end, not its result: raises only the caller's cancel
    if not task.cancelled() and (error := task.exception()) is not None:
        name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
        log.error("task %s ended with an error", name, exc_info=error)
